"""The optimizer's settings a recorded step read: noted by the recorder at the step's start (class, each parameter
group's lr, momentum, betas..., the line that built the optimizer), read back from the trace, and part of the trace
(a trace holding them is replaced and removed whole). Recording them changes nothing of the step."""
from __future__ import annotations

import torch

import replaydiff
from replaydiff.trace.hyperparameters import read_optimizer_steps
from replaydiff.trace.removal import remove_trace


def _step(trace, lr: float) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "lr": lr / 10}], lr=lr,
                          momentum=0.9)  # the optimizer's line
    with replaydiff.record(trace):
        model(torch.ones(4, 3)).sum().backward()
        opt.step()
    return model.weight.detach().clone()


def test_a_recorded_step_holds_each_group_s_settings_and_the_line_that_built_the_optimizer(tmp_path):
    _step(tmp_path / "t", 0.5)
    (step,) = read_optimizer_steps(tmp_path / "t" / "rank0")
    assert step.kind == "SGD" and len(step.groups) == 2
    groups = [dict(g) for g in step.groups]
    assert (groups[0]["lr"], groups[1]["lr"], groups[0]["momentum"]) == (0.5, 0.05, 0.9)
    line = next(n for n, text in enumerate(open(__file__).read().splitlines(), 1) if "opt = torch.optim.SGD" in text)
    assert step.built is not None and step.built.endswith(f"test_optimizer_settings.py:{line}")


def test_noting_the_settings_changes_nothing_and_the_trace_is_removed_whole(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    assert torch.equal(_step(tmp_path / "t", 0.5), model.weight.detach())
    remove_trace(tmp_path / "t")  # it refuses a directory holding a file that is not the trace's
    assert list((tmp_path / "t").iterdir()) == []
