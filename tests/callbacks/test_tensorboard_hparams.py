"""TensorBoard's HPARAMS tab (issue 19, item 7), read through tensorboard's own hparams plugin
(the backend of the tab, over an EventMultiplexer of the run directories): settings only,
named by what they set, written before the first batch, linked to the final metrics."""

from __future__ import annotations

import inspect
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.data_provider import MultiplexerDataProvider
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
from tensorboard.plugins.base_plugin import TBContext
from tensorboard.plugins.hparams.hparams_plugin import HParamsPlugin
from torch.utils.data import DataLoader, TensorDataset
from werkzeug.test import Client
from werkzeug.wrappers import Response

from hookloop import Callback, Loop
from hookloop.callbacks import (
    Checkpoint,
    CSVLogger,
    EarlyStopping,
    GradAccumulation,
    GradClip,
    TensorBoard,
)

from builders import Crash, RaiseAfterStep


def make_loop(tmp_path: Path, name: str, lr: float, max_norm: float,
              extra: tuple[Callback, ...] = ()) -> Loop:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    samples = TensorDataset(torch.randn(24, 5), torch.randint(0, 3, (24,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    callbacks = [GradClip(max_norm), GradAccumulation(2), EarlyStopping(patience=3),
                 CSVLogger(tmp_path / name / "log.csv"), *extra,
                 TensorBoard(tmp_path / "runs" / name, every_n_steps=1),
                 Checkpoint(tmp_path / name / "ckpt")]
    return Loop(model, optimizer, DataLoader(samples, batch_size=4),
                val_data=DataLoader(samples, batch_size=8), loss_fn=F.cross_entropy,
                callbacks=callbacks, device="cpu")


def session_groups(root: Path) -> dict[str, dict[str, Any]]:
    """What the HPARAMS tab lists: run name -> its session group (hparams, metric values,
    sessions with their status), from tensorboard's hparams plugin."""
    multiplexer = EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(root))
    multiplexer.Reload()
    context = TBContext(logdir=str(root), multiplexer=multiplexer,
                        data_provider=MultiplexerDataProvider(multiplexer, str(root)))
    app = HParamsPlugin(context).get_plugin_apps()["/session_groups"]
    request = {"startIndex": 0, "sliceSize": 100, "colParams": [], "includeMetrics": True,
               "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE",
                                   "STATUS_RUNNING"]}
    response = Client(app, Response).post("/session_groups", data=json.dumps(request),
                                          content_type="application/json")
    assert response.status_code == 200, response.get_data(as_text=True)
    return {group["name"]: group for group in json.loads(response.get_data())["sessionGroups"]}


def metric_values(group: dict[str, Any]) -> dict[str, tuple[float, int]]:
    return {value["name"]["tag"]: (value["value"], value["trainingStep"])
            for value in group["metricValues"]}


def test_two_runs_show_their_settings_and_final_metrics(tmp_path: Path) -> None:
    loops = {"fast": make_loop(tmp_path, "fast", 0.1, 1.0),
             "slow": make_loop(tmp_path, "slow", 0.01, 0.5)}
    states = {name: loop.fit(3) for name, loop in loops.items()}
    groups = session_groups(tmp_path / "runs")
    assert set(groups) == {"fast", "slow"}
    for name, (lr, max_norm) in {"fast": (0.1, 1.0), "slow": (0.01, 0.5)}.items():
        group, state = groups[name], states[name]
        params = group["hparams"]
        assert params["optimizer"] == "SGD"
        assert params["optimizer/lr"] == pytest.approx(lr)
        assert params["optimizer/momentum"] == pytest.approx(0.9)
        assert params["batch_size"] == 4 and params["epochs"] == 3
        assert params["accumulation_steps"] == 2 and params["GradAccumulation/steps"] == 2
        assert params["GradClip/max_norm"] == pytest.approx(max_norm)
        assert params["EarlyStopping/patience"] == 3
        assert params["EarlyStopping/monitor"] == "val_loss"
        assert params["Checkpoint/dirpath"] == str(tmp_path / name / "ckpt")  # a directory
        assert params["TensorBoard/log_dir"] == str(tmp_path / "runs" / name)
        assert "CSVLogger/path" not in params and "CSVLogger/every_n_steps" not in params
        # Settings only: no list positions, no run state, no file the run wrote.
        assert not [key for key in params if re.match(r"\d+\.", key)]
        arguments = {type(callback).__name__: set(inspect.signature(type(callback)).parameters)
                     for callback in loops[name].callbacks}
        for key in params:
            owner, _, argument = key.partition("/")
            if owner in arguments:  # a callback's entry names one of its constructor arguments
                assert argument.split("/")[0] in arguments[owner], key
        assert not [value for value in params.values()
                    if isinstance(value, str) and os.path.isfile(value)]
        assert len(params) < 40
        # The tab links them to the final metrics, at the final step.
        values = metric_values(group)
        assert values["metrics/val_loss"] == (pytest.approx(state.metrics["val_loss"], rel=1e-6),
                                              state.step)
        assert values["metrics/train_loss"][0] == pytest.approx(state.metrics["train_loss"],
                                                                rel=1e-6)
        assert [session["status"] for session in group["sessions"]] == ["STATUS_SUCCESS"]


def test_a_run_that_dies_still_shows_its_settings(tmp_path: Path) -> None:
    with pytest.raises(Crash):
        make_loop(tmp_path, "dead", 0.1, 1.0, extra=(RaiseAfterStep(5, boundary=True),)).fit(3)
    group = session_groups(tmp_path / "runs")["dead"]
    assert group["hparams"]["optimizer/lr"] == pytest.approx(0.1)
    assert metric_values(group)["step/loss"][1] == 5  # what it logged, to the step it died at
    assert [session["status"] for session in group["sessions"]] == ["STATUS_UNKNOWN"]


def test_the_settings_are_on_disk_before_the_first_batch(tmp_path: Path) -> None:
    seen: list[set[str]] = []

    class Peek(Callback):
        def on_batch_start(self, loop: Loop) -> None:
            if loop.state.step == 0 and loop.state.batch_idx == 0:
                events = EventAccumulator(str(tmp_path / "runs" / "peek"))
                events.Reload()
                seen.append(set(events.PluginTagToContent("hparams")))

    make_loop(tmp_path, "peek", 0.1, 1.0, extra=(Peek(),)).fit(1)
    assert seen == [{"_hparams_/session_start_info"}]
