"""`hookloop.export_safetensors` and ``hookloop export``: a checkpoint's weights in the Hugging
Face safetensors layout, read back with safetensors' own reader (``load_file``, ``safe_open``)
and compared with the trained model (``torch.equal``); the shards against a hand-computed
split. (A 2-rank directory of shards: tests/distributed/test_fsdp_two_processes.py.)"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

import hookloop
from hookloop import CheckpointError, ConfigurationError, Loop, export_safetensors
from hookloop.callbacks import EMA, Checkpoint

from conftest import console_script, subprocess_env

safetensors_torch = pytest.importorskip("safetensors.torch")
load_file, safe_open = safetensors_torch.load_file, pytest.importorskip("safetensors").safe_open


def model_three() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))


def trained(directory: Path, model: nn.Module, callbacks: list, **checkpoint) -> Loop:
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 4, generator=generator), torch.randn(4, 2, generator=generator))
            for _ in range(3)]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, val_data=data[:1],
                loss_fn=nn.functional.mse_loss, device="cpu",
                callbacks=[*callbacks, Checkpoint(directory, **checkpoint)])
    loop.fit(2)
    return loop


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One fit with an EMA and a best file: the rotating file of its last step, best.pt."""
    directory = tmp_path_factory.mktemp("run") / "ckpt"
    model, ema = model_three(), EMA(0.5)
    trained(directory, model, [ema], monitor="val_loss")
    return {"dir": directory, "last": directory / "epoch=0001-step=00000006.pt",
            "model": {name: value.clone() for name, value in model.state_dict().items()},
            "ema": ema.averaged_state_dict(), "best": directory / "best.pt"}


def test_a_file_exports_as_one_model_safetensors_equal_to_the_model(run, tmp_path) -> None:
    out = tmp_path / "export"
    assert export_safetensors(run["last"], out) == ["model.safetensors"]
    assert sorted(os.listdir(out)) == ["model.safetensors"]  # no index for one file
    read = load_file(out / "model.safetensors")
    assert list(read) == sorted(run["model"])
    assert all(torch.equal(read[name], value) for name, value in run["model"].items())
    with safe_open(out / "model.safetensors", "pt") as handle:
        assert handle.metadata() == {"format": "pt"}


def test_past_max_shard_size_the_files_and_index_are_laid_out_as_hugging_face_does(
        run, tmp_path) -> None:
    # float32 bytes: 0.weight 128, 0.bias 32, 1.weight 256, 1.bias 32, 2.weight 64, 2.bias 8.
    # A file takes tensors in order until the next would pass 300 bytes: 160 | 288 | 72.
    out = tmp_path / "export"
    names = export_safetensors(run["last"], out, max_shard_size=300)
    files = [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert names == [*files, "model.safetensors.index.json"]
    assert sorted(os.listdir(out)) == sorted(names)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": 128 + 32 + 256 + 32 + 64 + 8}, "weight_map": {
        "0.weight": files[0], "0.bias": files[0], "1.weight": files[1], "1.bias": files[1],
        "2.weight": files[2], "2.bias": files[2]}}
    together: dict[str, torch.Tensor] = {}
    for file in files:
        part = load_file(out / file)
        assert set(part) == {name for name, where in index["weight_map"].items() if where == file}
        assert not set(part) & set(together)  # every tensor in one file only
        together.update(part)
    assert set(together) == set(run["model"])
    assert all(torch.equal(together[name], value) for name, value in run["model"].items())
    # One tensor larger than the size gets a file of its own at once, while the open file
    # goes on taking the tensors after it (huggingface_hub's rule): with 200 bytes,
    # 1.weight (256) is the first file; 0.weight, 0.bias, 1.bias (192) the second.
    out = tmp_path / "export-big"
    export_safetensors(run["last"], out, max_shard_size="0.2KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert index["weight_map"] == {"1.weight": files[0], "0.weight": files[1],
                                   "0.bias": files[1], "1.bias": files[1],
                                   "2.weight": files[2], "2.bias": files[2]}


def test_ema_exports_the_averaged_weights(run, tmp_path) -> None:
    export_safetensors(run["last"], tmp_path / "ema", ema=True)
    read = load_file(tmp_path / "ema" / "model.safetensors")
    assert set(read) == set(run["ema"])
    assert all(torch.equal(read[name], value) for name, value in run["ema"].items())
    assert not torch.equal(run["ema"]["1.weight"], run["model"]["1.weight"])  # not the model's
    export_safetensors(run["last"], tmp_path / "named", ema="EMA")  # its state key
    assert torch.equal(load_file(tmp_path / "named" / "model.safetensors")["0.bias"],
                       run["ema"]["0.bias"])
    with pytest.raises(CheckpointError, match="no EMA state under 'other'.*EMA"):
        export_safetensors(run["last"], tmp_path / "other", ema="other")
    with pytest.raises(CheckpointError, match="best file.*without ema"):
        export_safetensors(run["best"], tmp_path / "best", ema=True)


def test_tied_weights_are_written_once_under_the_first_name(tmp_path) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 4)
            self.body = nn.Linear(4, 4)
            self.head = nn.Linear(4, 5, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    torch.manual_seed(0)
    model = Tied()
    data = [(torch.randn(3, 4), torch.randn(3, 5))]
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
         loss_fn=nn.functional.mse_loss, device="cpu",
         callbacks=[Checkpoint(tmp_path / "ckpt")]).fit(1)
    out = tmp_path / "export"
    export_safetensors(tmp_path / "ckpt" / "epoch=0000-step=00000001.pt", out,
                       max_shard_size=100)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == ["body.bias", "body.weight", "embed.weight"]
    assert index["metadata"]["total_size"] == 4 * (20 + 16 + 4)
    file = out / index["weight_map"]["embed.weight"]
    with safe_open(file, "pt") as handle:
        assert handle.metadata() == {"format": "pt", "head.weight": "embed.weight"}
    assert torch.equal(load_file(file)["embed.weight"], model.head.weight)
    fresh = Tied()
    safetensors_torch.load_model(fresh, file, strict=False)  # safetensors restores the tie
    assert torch.equal(fresh.head.weight, model.head.weight)


def test_bad_inputs_are_refused_by_name_before_anything_is_written(run, tmp_path) -> None:
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        export_safetensors(tmp_path / "missing.pt", out)
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        export_safetensors(tmp_path / "notes.pt", out)
    with pytest.raises(ConfigurationError, match="is a URL; only local paths"):
        export_safetensors("s3://bucket/ckpt/best.pt", out)
    with pytest.raises(CheckpointError, match="a directory of checkpoints .*export one"):
        export_safetensors(run["dir"], out)
    with pytest.raises(ConfigurationError, match="max_shard_size"):
        export_safetensors(run["last"], out, max_shard_size="5 parsecs")
    assert not out.exists()
    out.mkdir()
    (out / "model.safetensors").write_text("an earlier export")
    with pytest.raises(ConfigurationError, match="not empty .*model.safetensors"):
        export_safetensors(run["last"], out)
    assert (out / "model.safetensors").read_text() == "an earlier export"
    # A damaged file is refused by the checks every load makes (its archive's CRCs).
    damaged = tmp_path / "damaged.pt"
    content = bytearray(run["last"].read_bytes())
    content[len(content) // 2] ^= 0xFF
    damaged.write_bytes(bytes(content))
    with pytest.raises(CheckpointError, match="damaged.pt"):
        export_safetensors(damaged, tmp_path / "from-damaged")
    assert not (tmp_path / "from-damaged").exists()
    assert [name for name in os.listdir(tmp_path) if ".tmp-" in name] == []


def test_an_existing_empty_out_dir_is_filled(run, tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    assert hookloop.export_safetensors(run["last"], tmp_path / "empty") == ["model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["empty"]  # no temporary left beside it


@pytest.mark.slow
def test_the_command_writes_the_layout_and_says_what_is_wrong(run, tmp_path) -> None:
    command = [console_script("hookloop"), "export"]
    done = subprocess.run([*command, str(run["last"]), str(tmp_path / "out"), "--ema",
                           "--max-shard-size", "300"], env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wrote model-00001-of-00003.safetensors" in done.stdout
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    together = {name: tensor for file in set(index["weight_map"].values())
                for name, tensor in load_file(tmp_path / "out" / file).items()}
    assert all(torch.equal(together[name], value) for name, value in run["ema"].items())
    failed = subprocess.run([*command, "https://example.com/best.pt", str(tmp_path / "x")],
                            env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1
    assert "hookloop export: error:" in failed.stderr and "is a URL" in failed.stderr
