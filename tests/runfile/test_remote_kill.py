"""SIGKILLs during uploads to s3:// (moto on localhost): the relaunch resumes from the
store's newest complete save to the uninterrupted run's weights (tests/remote_kill_campaign)."""

from __future__ import annotations

from pathlib import Path

import pytest

from remote_kill_campaign import KEEP, campaign
from s3_endpoint import s3_endpoint


@pytest.mark.slow
def test_sigkill_during_uploads_to_s3_resumes_exactly(tmp_path: Path) -> None:
    with s3_endpoint() as options:
        counts = campaign("s3://runs/killed", options, str(tmp_path / "staging"), str(tmp_path),
                          kills=30, seconds=60.0, pause=1.5)
    print(f"{counts['kills']} kills, {counts['mid_upload']} left a partial upload, at most "
          f"{counts['most_rotating']} rotating saves listed (keep_last={KEEP})")
    assert counts["kills"] >= 10
    assert counts["mid_upload"] >= 1  # the kills did land in the middle of uploads
