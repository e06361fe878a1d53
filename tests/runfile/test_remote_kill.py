"""SIGKILLs during uploads to s3:// (moto on localhost): keep-last and top-k hold on the
store after every kill, and the relaunch resumes from the store's newest complete save to
the uninterrupted run's weights and best saves (tests/remote_kill_campaign)."""

from __future__ import annotations

from pathlib import Path

import pytest

from remote_kill_campaign import KEEP, campaign
from s3_endpoint import s3_endpoint


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_sigkill_during_uploads_to_s3_resumes_exactly(tmp_path: Path, async_save: bool) -> None:
    with s3_endpoint() as options:  # async: fewer kills, the mirror's path is the same
        counts = campaign(f"s3://runs/killed-{async_save}", options,
                          str(tmp_path / "staging"), str(tmp_path),
                          kills=15 if async_save else 30, seconds=300.0, pause=0.6,
                          async_save=async_save)
    print(f"{counts['kills']} kills ({'async' if async_save else 'sync'} saves), "
          f"{counts['mid_upload']} left a partial upload, at most {counts['most_rotating']} "
          f"rotating saves listed (keep_last={KEEP})")
    assert counts["kills"] == (15 if async_save else 30)  # the bound only stops a runaway
    assert counts["mid_upload"] >= 1  # the kills did land in the middle of uploads
