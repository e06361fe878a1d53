"""FSDP: real 2-process runs under torchrun (gloo, CPU) checked against a hand-written
single-process loop, and kills and relaunches checked against an uninterrupted run.

One module-scoped fixture runs the phases of scripts/fsdp.py in order (six launches, one
of them on a single process); each test reads what they wrote. Reduce-scatters are counted
by wrapping ``torch.distributed.reduce_scatter_single`` in the script: FSDP2's default
reduce-scatter calls it once per sharded parameter group and gradient reduction.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from builders import assert_close_weights
from conftest import ROOT, subprocess_env
from launch import SCRIPTS, TIMEOUT, read, run_ok, torchrun
from torch import nn

sys.path.insert(0, str(SCRIPTS))
import common
import fsdp as script

SCRIPT = SCRIPTS / "fsdp.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fsdp")
    outputs: dict[str, Any] = {"out": out, "train": run_ok(SCRIPT, str(out), "train")}
    for phase in ("kill-full", "resume-full-kill-sharded", "kill-async"):
        result = torchrun(SCRIPT, str(out), phase)
        outputs[phase] = result
    # The first checkpoint of the sharded run, for a one-process relaunch (copied before the
    # two-process relaunch prunes it).
    (out / "sharded-copy").mkdir()
    shutil.copytree(out / "sharded" / "epoch=0000-step=00000004.dcp",
                    out / "sharded-copy" / "epoch=0000-step=00000004.dcp")
    outputs["resume-sharded"] = run_ok(SCRIPT, str(out), "resume-sharded")
    outputs["one-rank"] = run_ok(SCRIPT, str(out), "one-rank", processes=1)
    return outputs


# ------------------------------------------------------------------ hand-written oracle
def hand_train(accumulation: int, val_samples: int) -> dict[str, Any]:
    """One process over the global batches: FSDP's rank r reads the ordered samples r, r+2,
    ...; a step of ``accumulation`` micro-batches of 4 on each of 2 ranks is the contiguous
    block of ``8 * accumulation`` samples, averaged as one batch."""
    model = script.make_model(seed=3)
    optimizer = script.make_optimizer(model)
    inputs, targets = common.regression_data(48, seed=1).tensors
    val_inputs, val_targets = common.regression_data(val_samples, seed=2).tensors
    window = 8 * accumulation
    norms: list[float] = []
    metrics = []
    for _ in range(2):
        total = 0.0
        for start in range(0, 48, window):
            part = slice(start, start + window)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(inputs[part]), targets[part])
            loss.backward()
            total += loss.item() * window
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                script.MAX_NORM)))
            optimizer.step()
        with torch.no_grad():
            val_loss = nn.functional.mse_loss(model(val_inputs), val_targets).item()
        metrics.append({"train_loss": total / 48, "val_loss": val_loss})
    return {"weights": model.state_dict(), "norms": norms, "metrics": metrics}


@pytest.mark.parametrize(("accumulation", "val_samples"), [(1, 9), (2, 8)])
def test_fsdp_training_equals_one_process_on_the_global_batch(
        runs: dict[str, Any], accumulation: int, val_samples: int) -> None:
    out = runs["out"]
    expected = hand_train(accumulation, val_samples)
    assert_close_weights(read(out, f"weights-accumulation{accumulation}", 0),
                         expected["weights"], atol=1e-5)
    for rank in (0, 1):
        log = read(out, f"log-accumulation{accumulation}", rank)
        assert log["parameter"] == "DTensor"  # the model really was sharded
        norms = [log["norms"][str(step)] for step in range(1, len(expected["norms"]) + 1)]
        assert min(norms) > script.MAX_NORM  # clipping was active at every step
        # GradClip's norm (loop.state.grad_norm) is the global one, on every rank.
        for got, want in zip(norms, expected["norms"], strict=True):
            assert abs(got - want) <= 1e-6 * max(1.0, want), (got, want)
        # Validation over 9 samples (5 + 4: the whole model gathered for the pass) and over
        # 8 (4 + 4: sharded forwards) counts every sample once, as one process does.
        for got, want in zip(log["metrics"], expected["metrics"], strict=True):
            for key in ("train_loss", "val_loss"):
                assert math.isclose(got[key], want[key], rel_tol=1e-5), (key, got, want)


def test_ema_over_shards_validates_with_the_averaged_weights_of_one_process(
        runs: dict[str, Any]) -> None:
    """The oracle averages the whole weights by hand (EMA's warmup decay) and validates with
    the average after each epoch."""
    model = script.make_model(seed=3)
    optimizer = script.make_optimizer(model)
    inputs, targets = common.regression_data(48, seed=1).tensors
    val_inputs, val_targets = common.regression_data(9, seed=2).tensors
    shadow = {name: value.detach().clone() for name, value in model.state_dict().items()}
    updates, val_losses = 0, []
    for _ in range(2):
        for start in range(0, 48, 8):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(inputs[start:start + 8]),
                                   targets[start:start + 8]).backward()
            optimizer.step()
            decay = min(0.5, (1 + updates) / (10 + updates))
            for name, value in model.state_dict().items():
                shadow[name].lerp_(value.detach(), 1 - decay)
            updates += 1
        averaged = script.make_model(seed=3)
        averaged.load_state_dict(shadow)
        with torch.no_grad():
            val_losses.append(nn.functional.mse_loss(averaged(val_inputs), val_targets).item())
    assert_close_weights(read(runs["out"], "ema-shadow", 0), shadow, atol=1e-5)
    for rank in (0, 1):
        got = [epoch["val_loss"] for epoch in read(runs["out"], "ema-metrics", rank)]
        for value, expected in zip(got, val_losses, strict=True):
            assert math.isclose(value, expected, rel_tol=1e-5), (got, val_losses)


def test_accumulation_four_reduce_scatters_once_per_optimizer_step(runs: dict[str, Any]
                                                                    ) -> None:
    for rank in (0, 1):
        counted = read(runs["out"], "reduce-scatters", rank)
        skipping, control = counted["skipping"], counted["control"]
        assert skipping["groups"] == 3  # the three Linear blocks (the root holds no parameter)
        assert skipping["steps"] == 4  # 6 micro-batches an epoch: windows of 4 and 2
        # One reduce-scatter per sharded group per optimizer step, none for the micro-batches
        # inside a window...
        assert skipping["per_step"] == [skipping["groups"]] * skipping["steps"]
        # ...where a run that never turns the sync off reduce-scatters at every backward,
        # which the count sees (windows of 4 and 2 micro-batches, 3 groups).
        assert control["per_step"] == [4 * 3, 2 * 3] * 2


def test_a_full_checkpoint_loads_into_an_unsharded_model(runs: dict[str, Any]) -> None:
    assert read(runs["out"], "full-file", 0) == {"equal": True, "keys": True}


def test_bf16_policy_and_fp16_with_the_sharded_grad_scaler_train(runs: dict[str, Any]) -> None:
    for rank in (0, 1):
        results = read(runs["out"], "precision", rank)
        assert results["bf16-policy"]["steps"] == 4 and results["bf16-policy"]["scaler"] is None
        assert results["fp16-amp"]["scaler"] == "ShardedGradScaler"
        assert results["fp16-amp"]["steps"] == 4  # no step skipped at this scale
        for label in results:
            assert all(math.isfinite(loss) for loss in results[label]["losses"])
    # The same skip decisions and steps on both ranks.
    assert read(runs["out"], "precision", 0)["fp16-amp"]["steps"] == \
        read(runs["out"], "precision", 1)["fp16-amp"]["steps"]


def _assert_equal_run(out: Path, label: str, first_step: int | tuple[int, ...]) -> None:
    """The relaunched run ends with the uninterrupted run's weights and EMA shadow, bit for
    bit, and each of its steps had the same loss."""
    for kind in ("weights", "ema"):
        reference, resumed = read(out, f"reference-{kind}", 0), read(out, f"{label}-{kind}", 0)
        assert reference.keys() == resumed.keys()
        for name in reference:
            assert torch.equal(resumed[name], reference[name]), (kind, name)
    for rank in (0, 1):
        losses = read(out, f"{label}-log", rank)["losses"]
        reference = read(out, "reference-log", rank)["losses"]
        assert min(map(int, losses)) in (first_step if isinstance(first_step, tuple)
                                         else (first_step,))
        assert {step: reference[step] for step in losses} == losses


def test_a_full_checkpoint_resumes_bit_exactly_after_a_kill_of_both_ranks(
        runs: dict[str, Any]) -> None:
    killed = runs["kill-full"]
    assert killed.returncode != 0 and "SIGKILL" in killed.stdout  # killed after step 5
    assert "resumed from" in runs["resume-full-kill-sharded"].stdout
    assert "epoch=0000-step=00000004.pt" in runs["resume-full-kill-sharded"].stdout
    _assert_equal_run(runs["out"], "resumed-full", first_step=5)


def test_a_kill_during_a_sharded_save_leaves_the_previous_checkpoint_which_resume_picks(
        runs: dict[str, Any]) -> None:
    killed = runs["resume-full-kill-sharded"]
    assert killed.returncode != 0 and "SIGKILL" in killed.stdout
    # The output of the launch that resumed the sharded run names the directory it took:
    # the checkpoint of step 4, not the one of step 6 whose save the kill interrupted.
    assert "resumed from" in runs["resume-sharded"]
    assert "epoch=0000-step=00000004.dcp" in runs["resume-sharded"]
    assert "step=00000006" not in runs["resume-sharded"]
    _assert_equal_run(runs["out"], "resumed-sharded", first_step=5)


def test_async_sharded_saves_resume_bit_exactly_after_a_kill_of_both_ranks(
        runs: dict[str, Any]) -> None:
    """Checkpoint(async_save=True) with sharded directories: the writer threads of both
    ranks save over their own gloo group while training goes on; SIGKILL after step 5 (the
    save of step 4 complete, or in flight and then left as a temporary that is never
    listed), and the relaunch ends on the uninterrupted run's weights and EMA."""
    killed = runs["kill-async"]
    assert killed.returncode != 0 and "SIGKILL" in killed.stdout
    assert f"resumed from {runs['out'] / 'async'}" in runs["resume-sharded"]
    # From step 4's directory, or step 2's when the kill came while step 4's was in flight.
    _assert_equal_run(runs["out"], "resumed-async", first_step=(3, 5))


def test_a_sharded_checkpoint_of_two_ranks_resumes_on_one_with_the_same_next_loss(
        runs: dict[str, Any]) -> None:
    out = runs["out"]
    one = read(out, "one-rank-log", 0)["losses"]
    assert list(one) == ["5"]  # one step from the checkpoint of step 4
    # Two ranks of batches of 4 report their own means; one rank's batch of 8 holds both.
    reference = [read(out, "reference-log", rank)["losses"]["5"] for rank in (0, 1)]
    assert math.isclose(one["5"], sum(reference) / 2, rel_tol=1e-6)
    # On two ranks the resumed run's next loss is the uninterrupted run's, bit for bit.
    assert [read(out, "resumed-sharded-log", rank)["losses"]["5"] for rank in (0, 1)] == reference


def test_a_sharded_checkpoint_of_two_ranks_exports_as_the_unsharded_weights(
        runs: dict[str, Any], tmp_path: Path) -> None:
    """``export_safetensors`` of the 2-rank run's last directory of shards, in this process
    (no group): read with safetensors' own reader into the unsharded model, the weights (and
    the EMA's) are the ones rank 0 gathered at the run's end; the index names each tensor
    once. A flipped byte in a shard is refused by the directory's digests."""
    load_file = pytest.importorskip("safetensors.torch").load_file
    from hookloop import CheckpointError, export_safetensors

    out = runs["out"]
    directory = out / "sharded" / "epoch=0001-step=00000016.dcp"  # keep_last=1: the end
    for ema, label in ((False, "resumed-sharded-weights"), (True, "resumed-sharded-ema")):
        expected = read(out, label, 0)
        target = tmp_path / label
        names = export_safetensors(directory, target, ema=ema, max_shard_size=300)
        assert names[-1] == "model.safetensors.index.json" and len(names) == 4
        text = (target / names[-1]).read_text()
        assert all(text.count(f'"{name}"') == 1 for name in expected)  # each named once
        loaded: dict[str, torch.Tensor] = {}
        for name in names[:-1]:
            part = load_file(target / name)
            assert not set(part) & set(loaded)
            loaded.update(part)
        model = script.make_model(seed=0)
        model.load_state_dict(loaded)  # strict: every tensor of the unsharded model, no other
        assert all(torch.equal(model.state_dict()[name], value)
                   for name, value in expected.items())
    damaged = tmp_path / "damaged.dcp"
    shutil.copytree(directory, damaged)
    shard = next(damaged.glob("*.distcp"))
    content = bytearray(shard.read_bytes())
    content[len(content) // 2] ^= 0xFF
    shard.write_bytes(bytes(content))
    with pytest.raises(CheckpointError, match=shard.name):
        export_safetensors(damaged, tmp_path / "from-damaged")


# ------------------------------------------------------------------------ the example
def test_example_runs_in_one_process_and_sharded_under_torchrun(tmp_path: Path) -> None:
    example = ROOT / "examples" / "fsdp.py"
    plain = subprocess.run([sys.executable, str(example), "--epochs", "1", "--max-steps", "2"],
                           cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                           timeout=TIMEOUT)
    assert plain.returncode == 0, plain.stderr[-4000:]
    assert "training on 1 process(es), device cpu: rank 0 holds 537,482 of the 537,482" \
        in plain.stdout
    assert "FSDP: not launched by torchrun" in plain.stderr
    output = run_ok(example, "--epochs", "1", "--accumulate", "2",
                    "--checkpoint-dir", str(tmp_path / "checkpoints"))
    # Rank 0 prints once, holding half of the weights.
    assert output.count("training on 2 process(es), device cpu: rank 0 holds 268,741 of") == 1
    assert "epoch 1/1  step 12" in output  # 23 batches per rank, windows of 2
    names = sorted(path.name for path in (tmp_path / "checkpoints").iterdir())
    assert names == ["best.dcp", "epoch=0000-step=00000012.dcp"]
