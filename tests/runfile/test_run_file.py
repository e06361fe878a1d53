"""Every key a real save writes is one of the `KEYS` of the envelope
(hookloop/runfile/format.py) or of the module of the part that writes it (issue 23, item 2;
issue 34). That each key is spelled in exactly one module is tests/test_architecture.py's
check."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hookloop import Loop
from hookloop.callbacks import Checkpoint
from hookloop.engine import position_part, rng, run_end, stateful
from hookloop.runfile import format as run_file
from hookloop.runfile import integrity, ranking, shard_files, weights
from hookloop.runfile.checkpoint_files import CheckpointFiles
from hookloop.runfile.shard_files import PLAIN_FILE

def test_the_keys_are_one_constant_each() -> None:
    assert len(set(run_file.KEYS)) == len(run_file.KEYS)
    assert run_file.SHARED_WORDS <= set(run_file.KEYS)
    constants = {value for name, value in vars(run_file).items()
                 if name.isupper() and isinstance(value, str)}
    assert set(run_file.KEYS) <= constants
    assert constants - set(run_file.KEYS) == {run_file.RESUME, run_file.BEST}  # the kinds


#: Every key of the file: the envelope's and each part's.
ALL_KEYS = set(run_file.KEYS).union(*(module.KEYS for module in (
    position_part, rng, run_end, stateful, integrity, ranking, shard_files, weights)))


def _format_keys(payload: Mapping[str, Any]) -> set[str]:
    """The keys of the format a payload holds: every level hookloop lays out, not the
    contents others own (weight names, a callback's state, torch's hyper-parameters)."""
    keys = set(payload)
    meta = payload[run_file.META]
    keys |= set(meta)
    for entry in meta.get(integrity.FILES, {}).values():
        keys |= set(entry)
    loop = payload.get(run_file.LOOP, {})
    keys |= set(loop)
    keys |= set(loop.get(run_end.ENDED) or {})
    for row in loop.get(stateful.HISTORY) or ():
        keys |= {run_file.EPOCH, run_file.STEP} & set(row)
    optimizer = payload.get(run_file.OPTIMIZER, {})
    keys |= set(optimizer)
    for group in optimizer.get(run_file.PARAM_GROUPS, ()):
        keys |= {run_file.PARAMS} & set(group)
    for part in payload.get(position_part.RANKS) or ():
        keys |= set(part) - {position_part.DATA_STATE}
        for name in (position_part.RNG, position_part.EPOCH_RNG, position_part.PREFETCH_RNG,
                     position_part.MARK_RNG):
            keys |= set(part.get(name) or {})
    top_k = payload.get(run_file.CALLBACKS, {}).get("Checkpoint", {}).get("top_k", ())
    for entry in top_k:  # the Checkpoint's ranking entries
        keys |= set(entry)
    return keys


def test_every_key_a_real_save_writes_is_one_of_keys(tmp_path: Path) -> None:
    """The oracle is the files themselves: a rotating file, best.pt, a scored file and a
    sharded directory's hookloop.pt, read back with torch.load."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(4)]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), data,
                loss_fn=torch.nn.functional.mse_loss, val_data=data[:2], device="cpu",
                callbacks=[Checkpoint(tmp_path / "run", monitor="val_loss", save_top_k=2,
                                      every_n_steps=3)])
    loop.fit(2, max_steps=7)
    files = sorted((tmp_path / "run").iterdir())
    assert any(path.name.startswith("epoch=") for path in files)
    assert any(path.name == "best.pt" for path in files)
    written: set[str] = set()
    for path in files:
        payload = torch.load(path, weights_only=True)
        written |= _format_keys(payload)
    sharded = CheckpointFiles(str(tmp_path / "sharded"))
    sharded.prepare()
    directory = sharded.write({run_file.META: run_file.file_meta(run_file.BEST),
                               run_file.MODEL: {"w": torch.ones(2)}}, "best.dcp", shards=True)
    sharded.release()
    written |= _format_keys(torch.load(os.path.join(directory, PLAIN_FILE), weights_only=True))
    assert written - ALL_KEYS == set()
    # The run wrote the parts this test means to see (not a vacuous subset).
    assert {integrity.SAVE_ID, integrity.FILES, integrity.DIGEST, integrity.BYTES,
            position_part.RNG, rng.RNG_TORCH, position_part.TRAIN_SAMPLES, stateful.HISTORY,
            run_file.MONITOR, run_file.VALUE, ranking.FILE, run_file.PARAMS} <= written
