"""Weights & Biases tracking: the run's scalars, settings and metadata in a W&B run."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hookloop.base.checks import check_path
from hookloop.errors import ConfigurationError
from hookloop.tracking import Row, Tracker, check_plain

if TYPE_CHECKING:
    from hookloop.checkpoint_uploads import Upload
    from hookloop.loop import Loop

__all__ = ["WandbLogger"]

#: The run's x axis: every value is logged with the loop's step under this key.
STEP_METRIC = "global_step"
#: W&B exit codes at fit end, by outcome (a suspended launch is marked preempting first).
_EXIT_CODE = {"finished": 0, "failed": 1, "killed": 130, "suspended": 75}
#: W&B's offline file: a 7-byte header, then records in 32 KiB blocks, each piece after a
#: 7-byte header (checksum, length, kind: 1 whole, 2 first, 3 middle, 4 last).
_BLOCK, _HEADER = 32768, 7


def _artifact_aliases(path: str) -> set[str]:
    """The aliases of the artifact records in the W&B offline file ``path`` (a killed
    launch's file ends after its last complete block: what is there is whole)."""
    from wandb.proto import wandb_internal_pb2

    aliases: set[str] = set()
    with open(path, "rb") as handle:
        block, offset, record = handle.read(_BLOCK), _HEADER, b""
        while block:
            if offset + _HEADER > len(block):
                block, offset = handle.read(_BLOCK), 0
                continue
            length, kind = struct.unpack_from("<HB", block, offset + 4)
            piece = block[offset + _HEADER:offset + _HEADER + length]
            offset += _HEADER + length
            if kind == 0 or len(piece) < length:  # padding, or a piece a kill cut
                block, offset = handle.read(_BLOCK), 0
                continue
            record = piece if kind in (1, 2) else record + piece
            if kind in (1, 4):
                parsed = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
                parsed.ParseFromString(record)
                if parsed.WhichOneof("record_type") == "artifact":
                    aliases.update(parsed.artifact.aliases)
    return aliases


def _check_tags(tags: Any) -> list[str] | None:
    """``tags`` as a list of strings (numbers are written as strings)."""
    if tags is None:
        return None
    if isinstance(tags, str):
        raise ConfigurationError(
            f"WandbLogger tags must be a list of tags, got the string {tags!r}, which would "
            f"make one tag per character ({', '.join(repr(c) for c in tags[:3])}...). Write "
            f"tags=[{tags!r}].")
    if isinstance(tags, Mapping) or not isinstance(tags, Iterable):
        raise ConfigurationError(f"WandbLogger tags must be a list of strings or None, got "
                                 f"{tags!r}. Write e.g. tags=['baseline', 'lr-0.1'].")
    tags = list(tags)
    check_plain("WandbLogger tags", tags, nested=False)
    return [str(tag) for tag in tags]


class WandbLogger(Tracker):
    """Log to a Weights & Biases run (rank 0 only): ``pip install 'hookloop[wandb]'``.

    What is sent (the same tags, cadence and steps as `TensorBoard`): the ``step/*``
    values every ``every_n_steps`` optimizer steps and every metric as
    ``metrics/<name>`` at each validation and epoch end, each send one row with
    ``global_step`` (``loop.state.step``), the x axis of every chart
    (``run.define_metric("*", step_metric="global_step")``); the run's settings as the run's config
    (once, when the run is created); the model summary and the end reason in the run's
    summary (``model``, ``parameters``, ``trainable_parameters``, ``end_reason``).

    The run: started at the first epoch (``wandb.init``), or continued
    (``wandb.init(id=..., resume="allow")``) when ``run_id`` is given or a checkpoint
    restored this callback's state. At fit end it is finished with exit code 0 when the
    run ended, 1 after an exception, 130 after Ctrl-C; a launch that ended while the run
    goes on (a signal, `TimeLimit`, ``loop.stop(resumable=True)``) marks the run
    preempting (``run.mark_preempting()``) and exits with 75, and the relaunch continues
    the same run. W&B keeps what it is given in memory until the run finishes (offline
    it writes its file in 32 KiB blocks), so what a launch sent stays in this callback's
    state until the run is closed (the closing launch then notes in W&B's folder,
    ``hookloop-closed-<run id>.json``, what the run holds): a relaunch after a kill sends
    it again, once. Online,
    the resumed run's summary says up to which ``global_step`` W&B has the values, and
    those are not sent again; offline, a killed launch's file keeps only its complete
    blocks, so in a long launch the rows of those blocks can appear twice after
    ``wandb sync``.

    Offline (``mode="offline"`` or ``WANDB_MODE=offline``) the runs are files under
    ``dir``/wandb, which ``wandb sync`` uploads later and ``wandb leet inspect`` reads.
    W&B's failures never stop training: see `hookloop.tracking.Tracker`.

    Args:
        project: The W&B project; None: W&B's default (``WANDB_PROJECT``...).
        entity: The W&B entity (user or team); None: the default.
        name: The display name of a new run.
        dir: The directory W&B writes under (its ``wandb`` folder); None: the current one.
        mode: ``"online"``, ``"offline"`` or ``"disabled"``; None: W&B's default
            (``WANDB_MODE``).
        tags: Tags of a new run.
        run_id: Continue this W&B run.
        every_n_steps: Step interval of the ``step/*`` values.
        hparams: Settings to send; None gathers them (`hookloop.scalars.gather_hparams`).
        log_checkpoints: ``"best"`` (each new best file of the stack's monitoring
            `Checkpoint`), ``"all"`` (every checkpoint file) or None/False (none, the
            default): each a version of the run's artifact ``checkpoints-<run id>`` (type
            ``model``) with its name (``best-step=00000012-val_loss=0.4321``) as an alias
            and its description, its step and value in the metadata, and the alias
            ``best`` on each new best. W&B's folder keeps a note
            (``hookloop-checkpoints-<run id>.json``) of the uploads W&B holds for sure
            (online: once W&B committed the version; offline: once the run is finished),
            and a relaunch uploads none of them again. Until then each upload's file stays
            linked in the checkpoint directory (``.upload-<run id>-<name>/``; offline that
            keeps the files a launch uploaded on disk until it ends): a relaunch after a
            kill uploads again each one W&B does not hold (offline: not in the note, nor
            in a record the killed launch's file kept), so each is uploaded once.

    Example:
        >>> WandbLogger("my-project", mode="offline")
        WandbLogger('my-project', every_n_steps=50)
    """

    library, extra = "wandb", "wandb"
    durable_sends = False

    def __init__(self, project: str | None = None, *, entity: str | None = None,
                 name: str | None = None, dir: str | os.PathLike[str] | None = None,
                 mode: str | None = None, tags: Sequence[str] | None = None,
                 run_id: str | None = None, every_n_steps: int = 50,
                 hparams: Mapping[str, Any] | None = None,
                 log_checkpoints: str | bool | None = None) -> None:
        super().__init__(every_n_steps=every_n_steps, hparams=hparams, run_id=run_id,
                         log_checkpoints=log_checkpoints)
        for label, value in (("project", project), ("entity", entity), ("name", name)):
            if value is not None and not isinstance(value, str):
                raise ConfigurationError(f"WandbLogger {label} must be a string or None, "
                                         f"got {value!r}.")
        if mode not in (None, "online", "offline", "disabled"):
            raise ConfigurationError(f"WandbLogger mode must be 'online', 'offline', "
                                     f"'disabled' or None, got {mode!r}.")
        self.project, self.entity, self.name = project, entity, name
        self.dir = None if dir is None else check_path(
            "WandbLogger dir", dir, hint="It is the folder W&B writes its 'wandb' folder "
                                         "under, e.g. dir='runs'; None: the current one.")
        self.mode = mode
        self.tags = _check_tags(tags)
        self._wandb: Any = None
        self._run: Any = None
        self._handed: list[str] = []  # checkpoints handed to W&B, not yet noted

    def __repr__(self) -> str:
        project = "" if self.project is None else f"{self.project!r}, "
        return f"WandbLogger({project}every_n_steps={self.every_n_steps})"

    @property
    def run(self) -> Any:
        """The open ``wandb`` run, for other callbacks to log through (None outside fit)."""
        return self._run

    # ------------------------------------------------------------------ Tracker
    def _import(self) -> None:
        if self._wandb is None:
            import wandb

            self._wandb = wandb

    def _where(self) -> str:
        return f"W&B project {self.project!r}" if self.project else "W&B"

    def _start(self, loop: Loop, run_id: str | None) -> str:
        if self.dir is not None:
            os.makedirs(self.dir, exist_ok=True)
        arguments: dict[str, Any] = {"project": self.project, "entity": self.entity,
                                     "dir": self.dir, "mode": self.mode,
                                     "reinit": "create_new"}
        if run_id is None:
            arguments.update(name=self.name, tags=self.tags)
        else:
            arguments.update(id=run_id, resume="allow")
        self._run = run = self._wandb.init(**{key: value for key, value in arguments.items()
                                              if value is not None})
        # The x axis is the loop's step: every send is its own committed row (a row W&B holds
        # open until a later step would be lost with a killed process).
        run.define_metric(STEP_METRIC)
        run.define_metric("*", step_metric=STEP_METRIC)
        return str(run.id)

    def _already_sent(self) -> dict[str, int]:
        # What a closed launch sent is on disk (or the server): the closing launch wrote it
        # down in W&B's folder. Online, the resumed run's summary holds the latest
        # global_step W&B has, too. What a killed launch sent is in neither: sent again.
        sent: dict[str, int] = {}
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            with open(self._closed_file(), encoding="utf-8") as handle:
                sent = {str(tag): int(step) for tag, step in json.load(handle).items()}
        step = self._run.summary.get(STEP_METRIC)
        if isinstance(step, (int, float)) and not isinstance(step, bool):
            sent["*"] = max(sent.get("*", -1), int(step) - 1)
        return sent

    def _closed_file(self) -> str:
        return os.path.join(self._run.settings.wandb_dir, f"hookloop-closed-{self.run_id}.json")

    def _send(self, rows: list[Row]) -> None:
        for step, values, _ in rows:
            self._run.log({**values, STEP_METRIC: step})

    def _checkpoints_file(self) -> str:
        return os.path.join(self._run.settings.wandb_dir,
                            f"hookloop-checkpoints-{self.run_id}.json")

    def _logged_checkpoints(self) -> set[str]:
        names: set[str] = set()
        with contextlib.suppress(OSError, ValueError, TypeError):
            with open(self._checkpoints_file(), encoding="utf-8") as handle:
                names = {str(name) for name in json.load(handle)}
        if self._run.settings._offline:  # what a killed launch's file kept
            for path in glob.glob(os.path.join(glob.escape(self._run.settings.wandb_dir),
                                               f"*-{self.run_id}", f"run-{self.run_id}.wandb")):
                with contextlib.suppress(Exception):  # an unreadable file: as if empty
                    names |= _artifact_aliases(path)
        return names

    def _upload_checkpoint(self, upload: Upload) -> bool:
        artifact = self._wandb.Artifact(f"checkpoints-{self.run_id}", type="model",
                                        description=upload.name, metadata=upload.metadata())
        if os.path.isdir(upload.path):
            artifact.add_dir(upload.path, name=upload.file)
        else:
            artifact.add_file(upload.path, name=upload.file)
        aliases = [upload.name, *(["best"] if upload.kind == "best" else [])]
        logged = self._run.log_artifact(artifact, aliases=aliases)
        self._handed.append(upload.name)
        if self._run.settings._offline:  # held for sure once the run is finished
            return False
        logged.wait()  # online: noted once W&B committed the version
        self._note_checkpoints()
        return True

    def _note_checkpoints(self) -> None:
        """Note the uploads W&B holds for sure (online: committed; offline: once the run is
        finished, its file complete), so a relaunch skips them."""
        if self._handed:
            path = self._checkpoints_file()
            names = sorted(self._logged_checkpoints() | set(self._handed))
            with open(path + ".tmp", "w", encoding="utf-8") as handle:
                json.dump(names, handle)
            os.replace(path + ".tmp", path)
            self._handed = []

    def _send_settings(self, settings: dict[str, Any]) -> None:
        self._run.config.update(settings, allow_val_change=True)

    def _send_metadata(self, metadata: dict[str, Any]) -> None:
        self._run.summary.update(metadata)

    def _close(self, outcome: str, reason: str) -> None:
        run, self._run = self._run, None
        if run is None:
            return
        if outcome == "suspended":
            with contextlib.suppress(Exception):  # the exit code says it too
                run.mark_preempting()
        path = os.path.join(run.settings.wandb_dir, f"hookloop-closed-{self.run_id}.json")
        disabled = bool(getattr(run, "disabled", False))
        run.finish(exit_code=_EXIT_CODE[outcome])
        if disabled:  # mode="disabled": nothing was kept anywhere, nor will be
            self._uploads.confirm()
            return
        self._run = run  # for the note's folder
        self._note_checkpoints()
        self._uploads.confirm()  # the staged links of offline uploads go
        self._run = None
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w", encoding="utf-8") as handle:  # finished: on disk now
            json.dump(self._sent, handle)
        os.replace(path + ".tmp", path)
