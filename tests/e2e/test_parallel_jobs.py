"""Real parallel jobs as users write and run them (tests/e2e/parallel_jobs/: hand-written DDP, torch's DDP, FSDP2,
transformers.Trainer, Lightning), each recorded as a user records it, the single process and the torchrun launch:

    replaydiff record --step N -o single -- python job.py
    replaydiff record --step N -o multi -- torchrun --standalone --nproc-per-node 2 job.py
    replaydiff diff single multi --json -

A job checked at several steps (FSDP2, the Trainer and Lightning at steps 1 and 2) is recorded once over them
(``replaydiff record --steps 1-2``) and diffed a step at a time (``replaydiff diff single multi --step N``): a step
of that recording holds the ops, sources and diff a ``--step N`` recording holds (checked by hand for fsdp_tokens,
trainer_tokens and lightning_ddp: the same ops and sources, each step's diff report the same but for op indices and
its "comparing step N" line), and each pair of launches saved is 30-70 s on the shared machine.

A correct job agrees (exit 0, no difference found); a job with a planted bug exits 1 and names the line the bug
enters (the script's line marked ``# BUG``, read from the script, never typed in) in words that fit the cause.

The jobs are written apart from the engine: each writes (from rank 0, to $JOB_RESULT) its parameters after the last
step and a hash of each step's global batch, so that the test checks, independently of replaydiff's diff, that the
pair saw the same global batch and that a correct job ends where its single process ends (and a buggy one does not).
A recording changes no bit of a job's results, so the recorded runs give these.

torchrun is launched as ``python -m torch.distributed.run`` (the same program; a venv whose torch comes from another
environment has no ``torchrun`` script). Each recording pair costs four processes' imports (more with 4 ranks):
18 recording pairs for 21 checked pairs: the file took 831 s of wall time (410 CPU-seconds) on the shared 2-core
machine at load 5-7, beside a run of its earlier form, which took 955 s (21 pairs).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from process_helpers import child_env
from replaydiff.cli.main import main
from replaydiff.trace.samplers import SAMPLERS, write_samplers
from replaydiff.trace.schema.samplers import SamplerBuilt, SamplersNote

pytestmark = pytest.mark.slow

JOBS = Path(__file__).resolve().parent / "parallel_jobs"
BUG = "# BUG"


@dataclass(frozen=True)
class Job:
    """A job script, the world size and step it is recorded at; for a buggy job the words (regular expressions, all
    of which the diff must say) that fit its cause, and the words that must not appear (a wrong cause)."""
    script: str
    world: int = 2
    step: int = 1
    words: tuple[str, ...] = ()
    not_words: tuple[str, ...] = ()
    same_batch: bool = True  # the pair sees the same global batch (False where the bug is that it does not)
    headline: bool = False  # the bug's line is where the diff says the runs part (not only in its explanation)
    # a correct job every compared op of which maps (no value parts on the way, not only the values it keeps agree),
    # with these (phase, layout family) among the summary's: what the job's parallelism must be read as
    layouts: tuple[tuple[str, str], ...] = ()

    @property
    def correct(self) -> bool:
        return not self.bug_lines

    @property
    def bug_lines(self) -> list[int]:
        """The script's lines that carry the ``# BUG`` marker (where the planted bug enters)."""
        text = (JOBS / self.script).read_text().splitlines()
        return [n for n, line in enumerate(text, 1) if BUG in line]

    @property
    def id(self) -> str:
        return f"{self.script.removesuffix('.py')}-step{self.step}"


ROUTED, HELD = "routed to experts (all-to-all blocks)", "held by its expert's rank"  # expert parallelism's

# The rows at the step it names (Lightning at --step 2, where the sampler picks rows inside the step), and
# a second step of torch's DDP, of FSDP2 (its parameters, DTensors the first step updated, enter as step inputs) and
# of the Trainer, and Lightning at step 1 too.
# Each pair costs 4 processes' torch imports (~15 s on an idle 2-core machine; the Trainer's ~30 s).
CORRECT = [
    Job("ddp_tokens.py"),
    Job("ddp_module_tokens.py"),
    Job("ddp_module_tokens.py", step=2),
    Job("fsdp_tokens.py"),
    Job("fsdp_tokens.py", step=2),
    Job("fsdp_adamw_clip.py", world=4),
    Job("ddp_no_sync.py"),
    Job("ddp_no_sync_micro.py"),
    Job("trainer_tokens.py"),
    Job("trainer_tokens.py", step=2),
    Job("lightning_ddp.py"),
    Job("lightning_ddp.py", step=2),
    Job("lightning_classes.py", step=2),
    Job("moe_experts.py", layouts=(("forward", ROUTED), ("forward", HELD), ("optimizer", HELD))),
    Job("moe_experts_multi.py", layouts=(("forward", ROUTED), ("forward", HELD), ("backward", HELD),
                                         ("optimizer", HELD))),
    Job("moe_fused.py", layouts=(("forward", ROUTED), ("backward", ROUTED), ("optimizer", "sharded on dim 0"))),
]
BUGGY = [
    Job("ddp_double_scale.py", words=(r"\b2x\b|twice",), not_words=(r"learning rate",), headline=True),
    Job("ddp_loss_world.py", words=(r"\b2x\b|by 2\b", r"world size"), not_words=(r"learning rate", r"twice"),
        headline=True),
    Job("ddp_rank_mean.py", words=(r"per-rank mean|means? over .*(unequal|different)|different (token )?counts",),
        not_words=(r"scaled by the world size",)),
    Job("trainer_rank_mean.py", words=(r"per-rank mean|means? over .*(unequal|different)|different (token )?counts",),
        not_words=(r"scaled by the world size", r"overlap")),
    Job("tp_no_input_grad.py", words=(r"partial|all-reduce|not (summed|reduced)",)),
    Job("ddp_same_shard.py", words=(r"same (\d+ )?rows|identical rows|same (data )?shard",), same_batch=False),
    Job("ddp_no_sync_undivided.py", words=(r"not divided by the number of micro-batches", r"\b2x\b"),
        not_words=(r"world size", r"unequal")),
    Job("ddp_no_sync_never_reduced.py", words=(r"without its all-reduce", r"no all-reduce follows the last one's",
                                                r"2 micro-batches"), not_words=(r"scaled by the world size",)),
    Job("ddp_lr_scaled.py", words=(r"learning rate|\blr\b", r"\b0\.1\b", r"\b0\.2\b"),
        not_words=(r"scaled by the world size twice",)),
    Job("moe_experts_grad_reduced.py", words=(r"different experts", r"all-reduce"), not_words=(r"BatchNorm",)),
    Job("moe_fused_grad_reduced.py", words=(r"different experts", r"all-reduce", r"own experts' part"),
        not_words=(r"BatchNorm",)),
    Job("moe_experts_multi_misrouted.py", words=(r"rows between them in another order", r"other tokens' expert results",
                                                 r"alltoall"), not_words=(r"BatchNorm", r"all-reduce")),
]

# What the engine reads the wrong way round today (issue 33): strict, so that a job it gets right fails here and
# tells its developer to remove the marker.
TODAY_WRONG: dict[str, str] = {
}


class RecordingFailed(Exception):
    """A job did not record (it failed, or its recording did): never what an xfail of the diff's verdict expects."""


def _marks(job: Job) -> list:
    reason = TODAY_WRONG.get(job.id)
    return [pytest.mark.xfail(strict=True, raises=AssertionError, reason=f"issue 33: {reason}")] if reason else []


@dataclass(frozen=True)
class Pair:
    """One job's recordings and what came of them."""
    code: int  # replaydiff diff's exit code
    report: dict  # its --json document
    single: dict  # the jobs' own results ($JOB_RESULT): parameters after the last step, global-batch hashes
    multi: dict
    traces: tuple[Path, Path]  # the single process's trace, the parallel run's


@contextmanager
def _environment(**extra: str):
    """os.environ as a recorded job's child sees it (no inherited rank variables), with ``extra`` set; restored."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(child_env(), **extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _steps(job: Job) -> list[int]:
    """The steps this job's script is checked at (at this world size): one recording holds them all."""
    return sorted({j.step for j in CORRECT + BUGGY if (j.script, j.world) == (job.script, job.world)})


def _recording(job: Job) -> tuple[str, list[str]]:
    """The name of the recordings that hold ``job``'s step, and record's option that picks their steps: ``--step N``
    for a job checked at one step (as users record it), ``--steps A-B`` over every step a job is checked at."""
    steps = _steps(job)
    if len(steps) == 1:
        return job.id, ["--step", str(job.step)]
    return f"{job.script.removesuffix('.py')}-steps{steps[0]}-{steps[-1]}", ["--steps", f"{steps[0]}-{steps[-1]}"]


def _record(job: Job, where: Path, world: int) -> dict:
    for prefix, framework in (("lightning_", "lightning"), ("trainer_", "transformers")):
        if job.script.startswith(prefix):
            assert find_spec(framework), f"{framework} (pyproject's test extra) is not installed: pip install -e '.[test]'"
    name, steps = _recording(job)
    out = f"{name}-{world}"
    result = where / f"{out}.json"
    launch = [sys.executable, job.script] if world == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), job.script]
    old = os.getcwd()
    os.chdir(where)
    try:
        # Twice at most: torch's gloo process group can abort a rank at interpreter exit ("terminate called without
        # an active exception"), recorded or not (about 1 launch in 100 here: tests/bench/README.md), which fails
        # the launch after the job's work is done. A recorder that broke the job would fail both times.
        for attempt in range(2):
            with _environment(JOB_RESULT=str(result)):
                code = main(["record", *steps, "-o", out, "--", *launch])
            if code == 0 or world == 1 or attempt == 1:
                break
            shutil.rmtree(where / out, ignore_errors=True)
            result.unlink(missing_ok=True)
    finally:
        os.chdir(old)
    if code != 0:
        raise RecordingFailed(f"replaydiff record of {out} exited {code} (the job's stderr is in the captured output)")
    return json.loads(result.read_text())


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """pairs(job) -> Pair: the job recorded as a single process and under torchrun, then diffed at its step; each
    recording once per module (the checks of one pair share its recordings, and the steps of one script share
    them: see _recording)."""
    where = tmp_path_factory.mktemp("jobs")
    for script in JOBS.glob("*.py"):
        shutil.copy(script, where / script.name)
    recorded: dict[str, tuple[dict, dict] | RecordingFailed] = {}
    done: dict[Job, Pair] = {}

    def get(job: Job) -> Pair:
        name, steps = _recording(job)
        if name not in recorded:
            try:
                recorded[name] = _record(job, where, 1), _record(job, where, job.world)
            except RecordingFailed as e:
                recorded[name] = e  # each later test of these recordings says the same, not that the trace exists
                raise
        if isinstance(recorded[name], RecordingFailed):
            raise recorded[name]
        if job not in done:
            single, multi = recorded[name]
            out = where / f"{job.id}.diff.json"
            traces = where / f"{name}-1", where / f"{name}-{job.world}"
            pick = ["--step", str(job.step)] if steps[0] == "--steps" else []
            code = main(["diff", str(traces[0]), str(traces[1]), *pick, "--json", str(out)])
            report = json.loads(out.read_text())
            # the step the job is checked at, and it alone, was compared
            assert not pick or report["steps"].startswith(f"comparing step {job.step} "), report["steps"]
            done[job] = Pair(code, report, single, multi, traces)
        return done[job]

    return get


def _said(report: dict) -> str:
    """Everything the diff says of where the runs part (its verdict, the parallel mapping's findings), as one text."""
    strings: list[str] = []

    def walk(v) -> None:
        if isinstance(v, str):
            strings.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    walk(report.get("first_divergent"))
    walk(report.get("parallel"))
    return "\n".join(strings)


def _max_param_difference(a: dict, b: dict) -> float:
    assert a["params"].keys() == b["params"].keys()
    return max((torch.tensor(a["params"][k]) - torch.tensor(b["params"][k])).abs().max().item() for k in a["params"])


@pytest.mark.parametrize("job", [pytest.param(j, id=j.id, marks=_marks(j)) for j in CORRECT])
def test_a_correct_job_agrees_with_its_single_process(pairs, job: Job) -> None:
    pair = pairs(job)
    assert pair.code == 0 and pair.report["found_difference"] is False, _said(pair.report)[:3000]
    # and no warning says otherwise (a DistributedSampler's interleaved rows read as another global batch did)
    assert not [w for w in pair.report.get("warnings", []) if "global batch" in w], pair.report["warnings"]
    if job.layouts:
        parallel = pair.report["parallel"]
        assert not parallel["cancelled"], parallel["cancelled"]
        for phase, layout in job.layouts:
            assert layout in parallel["families"].get(phase, {}), (phase, layout, parallel["families"])


@pytest.mark.parametrize("job", [pytest.param(j, id=j.id, marks=_marks(j)) for j in BUGGY])
def test_a_buggy_job_is_named_where_its_bug_enters(pairs, job: Job) -> None:
    pair = pairs(job)
    said = _said(pair.report)
    assert pair.code == 1 and pair.report["found_difference"] is True, said[:3000]
    named = {int(n) for n in re.findall(rf"{re.escape(job.script)}:(\d+)", said)}
    assert named & set(job.bug_lines), f"the bug's line {job.bug_lines} is not named (named: {sorted(named)}):\n" + \
        said[:3000]
    if job.headline:  # where the runs part: the op only the ranks run that applies the difference, or the op
        d = pair.report["parallel"]["departure"]
        head = (d.get("enters") or d)["source"] or ""
        at = re.search(rf"(?:^|/){re.escape(job.script)}:(\d+)$", head)
        assert at is not None and int(at[1]) in job.bug_lines, f"the runs part at {head!r}:\n{said[:3000]}"
    for words in job.words:
        assert re.search(words, said, re.IGNORECASE), f"{words!r} not said:\n{said[:3000]}"
    for words in job.not_words:
        assert not re.search(words, said, re.IGNORECASE), f"{words!r} said, which is not the cause:\n{said[:3000]}"


# each script once (its first pair): what the job itself writes does not depend on the step recorded
ONCE = [j for i, j in enumerate(CORRECT + BUGGY) if j.script not in {k.script for k in (CORRECT + BUGGY)[:i]}]


@pytest.mark.parametrize("job", [pytest.param(j, id=j.id) for j in ONCE])
def test_each_pair_sees_the_same_global_batch(pairs, job: Job) -> None:
    """The jobs' own account, apart from replaydiff: a hash of each step's rows over every rank. Only the job whose
    bug is that the ranks read the same shard sees another global batch."""
    pair = pairs(job)
    assert len(pair.single["batches"]) >= 2  # at least 2 steps, so --step 2 can be recorded
    assert (pair.single["batches"] == pair.multi["batches"]) is job.same_batch


@pytest.mark.parametrize("job", [pytest.param(j, id=j.id) for j in ONCE])
def test_a_correct_job_ends_where_its_single_process_ends_and_a_bug_does_not(pairs, job: Job) -> None:
    """The parameters after the last step, single process against rank 0 of the parallel run: equal within float32
    rounding of reordered sums for a correct job; for a buggy job well apart (the bug is real)."""
    pair = pairs(job)
    worst = _max_param_difference(pair.single, pair.multi)
    if job.correct:
        assert worst < 1e-5
    else:
        assert worst > 1e-3


def test_the_words_of_the_same_shard_follow_what_the_ranks_noted_of_their_samplers(pairs, tmp_path, capsys):
    """The same-shard pair's parallel trace with other sampler notes written in (the ops, hence the departure, stay
    the same): a sampler given one replica on 2 ranks, none built (a plain DataLoader on every rank: what to check,
    no line), samplers that take each rank's own share (the rows come from elsewhere), and notes that are someone
    else's data: a line holding control characters reaches the terminal as visible escapes, and a note that is not
    sound is no note (the general cause, no line)."""
    job = next(j for j in BUGGY if j.script == "ddp_same_shard.py")
    single, multi = pairs(job).traces
    copy = tmp_path / "multi"
    shutil.copytree(multi, copy)

    def said(*notes: SamplersNote | str) -> str:
        for rank, note in enumerate(notes):
            if isinstance(note, str):
                (copy / f"rank{rank}" / SAMPLERS).write_text(note)
            else:
                write_samplers(copy / f"rank{rank}", note)
        capsys.readouterr()
        assert main(["diff", str(single), str(copy)]) == 1
        return capsys.readouterr().out

    one = SamplerBuilt("DistributedSampler", "train.py:16", 0, 1, 0, 1)
    out = said(*[SamplersNote(True, (one,))] * 2)
    assert "the same shard; the DistributedSampler built at train.py:16 was given num_replicas=1 on 2 ranks: each " \
           "rank reads the whole dataset" in out
    out = said(*[SamplersNote(True, ())] * 2)
    assert "no rank built a DistributedSampler: check how each rank gets its own rows (a DataLoader without a " \
           "sampler reads the whole dataset on every rank" in out
    assert not re.search(r"\.py:\d+ was given|built at", out)
    out = said(*[SamplersNote(True, (SamplerBuilt("DistributedSampler", "train.py:16", r, 2, r, 2),)) for r in (0, 1)])
    assert "the DistributedSampler built at train.py:16 takes each rank's own share" in out
    spoof = SamplerBuilt("DistributedSampler\x1b[2J", "train.py:16\n  agree: every op maps", 0, 2, 0, 2)
    out = said(SamplersNote(True, ()), SamplersNote(True, (spoof,)))
    assert "DistributedSampler\\x1b[2J built at train.py:16\\n  agree: every op maps was given rank=0 on rank 1" in out
    assert "\x1b" not in out and "\n  agree" not in out
    out = said(*['{"v": 1, "whole_process": true, "samplers": [{"kind": 7}]}'] * 2)
    assert "the same shard; a sampler or split given the same rank on every rank" in out
    assert not re.search(r"\.py:\d+ was given|built at", out)
