"""MLflow tracking: the run's scalars, settings and metadata in an MLflow run."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hookloop.errors import ConfigurationError
from hookloop.tracking import Row, Tracker, check_plain

if TYPE_CHECKING:
    from hookloop.checkpoint_uploads import Upload
    from hookloop.loop import Loop

__all__ = ["MLflowLogger"]

# MLflow's limits: names of letters, digits and _-. /; 100 params and 1000 metrics a batch.
_NAME = re.compile(r"[^\w\-. /]")
_PARAMS_PER_BATCH, _METRICS_PER_BATCH, _PARAM_LENGTH = 100, 1000, 6000
#: Run status at fit end, by outcome; a suspended launch leaves the run RUNNING.
_STATUS = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}
#: The run's artifact folder of the uploaded checkpoints (``log_checkpoints``).
_CHECKPOINTS = "checkpoints"


def _name(key: str) -> str:
    return _NAME.sub("_", key)


def _param_name(key: str) -> str:
    # A file store keeps each param in a file named by it: "optimizer" and "optimizer/lr"
    # cannot both exist there, so the settings' "/" become ".".
    return _name(key).replace("/", ".")


class MLflowLogger(Tracker):
    """Log to an MLflow run (rank 0 only): ``pip install 'hookloop[mlflow]'``.

    What is sent (the same tags, cadence and steps as `TensorBoard`): the ``step/*``
    values every ``every_n_steps`` optimizer steps and every metric as
    ``metrics/<name>`` at each validation and epoch end, as MLflow metrics with
    ``step=loop.state.step``; the run's settings as MLflow params (once, when the run is
    created, named with ``.`` for ``/``, as in ``optimizer.lr`` and ``GradClip.max_norm``;
    characters MLflow refuses in a name become ``_``); the model summary and the end reason as tags
    (``hookloop.model``, ``hookloop.parameters``, ``hookloop.trainable_parameters``,
    ``hookloop.end_reason``).

    The run: created in ``experiment`` (made if missing) at the first epoch, or continued
    when ``run_id`` is given or a checkpoint restored this callback's state. At fit end it
    is marked ``FINISHED`` when the run ended, ``FAILED`` after an exception, ``KILLED``
    after Ctrl-C; a launch that ended while the run goes on (a signal, `TimeLimit`,
    ``loop.stop(resumable=True)``) leaves it ``RUNNING``, and the relaunch continues it.
    A relaunch after a kill sends no step twice: the run's metric history says which
    steps MLflow already has.

    MLflow's failures (a server that is down, a crash inside mlflow) never stop training:
    see `hookloop.tracking.Tracker`. A remote server that hangs costs its HTTP timeout and
    retries at every try; ``MLFLOW_HTTP_REQUEST_TIMEOUT`` and
    ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` bound them.

    Args:
        experiment: The experiment's name; None: MLflow's default experiment.
        tracking_uri: Where MLflow stores runs (``"sqlite:///mlflow.db"``, an
            ``http://`` server, a ``file:`` directory); None: MLflow's own default
            (``MLFLOW_TRACKING_URI``...).
        run_name: The name of a new run.
        tags: More tags for a new run.
        run_id: Continue this MLflow run.
        every_n_steps: Step interval of the ``step/*`` values.
        hparams: Settings to send; None gathers them (`hookloop.scalars.gather_hparams`).
        log_checkpoints: ``"best"`` (each new best file of the stack's monitoring
            `Checkpoint`), ``"all"`` (every checkpoint file) or None/False (none, the
            default): each uploaded as the run's artifact
            ``checkpoints/<name>/<file>``, the name saying its step and monitored value
            (``checkpoints/best-step=00000012-val_loss=0.4321/best.pt``). A relaunch
            lists the run's artifacts and uploads none twice; an upload a kill interrupted
            (its files not all there with their full sizes) is uploaded again.

    Example:
        >>> logger = MLflowLogger("my-experiment", tracking_uri="sqlite:///mlflow.db")
        >>> logger
        MLflowLogger('my-experiment', every_n_steps=50)
    """

    library, extra = "mlflow", "mlflow"

    def __init__(self, experiment: str | None = None, *, tracking_uri: str | None = None,
                 run_name: str | None = None, tags: Mapping[str, Any] | None = None,
                 run_id: str | None = None, every_n_steps: int = 50,
                 hparams: Mapping[str, Any] | None = None,
                 log_checkpoints: str | bool | None = None) -> None:
        super().__init__(every_n_steps=every_n_steps, hparams=hparams, run_id=run_id,
                         log_checkpoints=log_checkpoints)
        for label, value in (("experiment", experiment), ("tracking_uri", tracking_uri),
                             ("run_name", run_name)):
            if value is not None and not isinstance(value, str):
                raise ConfigurationError(f"MLflowLogger {label} must be a string or None, "
                                         f"got {value!r}.")
        self.experiment = experiment
        self.tracking_uri = tracking_uri
        self.run_name = run_name
        if tags is not None and not isinstance(tags, Mapping):
            raise ConfigurationError(f"MLflowLogger tags must be a dict of name -> value or "
                                     f"None, got {tags!r}. Write e.g. tags={{'team': 'vision'}}.")
        if tags is not None:
            check_plain("MLflowLogger tags", dict(tags), nested=False)
        self.tags = {} if tags is None else {str(key): str(value) for key, value in tags.items()}
        self._client: Any = None
        self._entities: Any = None
        self._client_class: Any = None

    def __repr__(self) -> str:
        name = "" if self.experiment is None else f"{self.experiment!r}, "
        return f"MLflowLogger({name}every_n_steps={self.every_n_steps})"

    @property
    def client(self) -> Any:
        """The ``mlflow.MlflowClient`` in use (None before the first fit's setup)."""
        return self._client

    # ------------------------------------------------------------------ Tracker
    def _import(self) -> None:
        if self._entities is None:
            import mlflow.entities
            from mlflow.tracking import MlflowClient

            self._entities, self._client_class = mlflow.entities, MlflowClient

    def _where(self) -> str:
        uri = self.tracking_uri
        if uri is None and self._client is not None:
            uri = getattr(self._client, "tracking_uri", None)
        return f"MLflow ({uri})" if uri else "MLflow"

    def _start(self, loop: Loop, run_id: str | None) -> str:
        if self._client is None:  # here, not at setup: a store that fails to open is retried
            self._client = self._client_class(self.tracking_uri)
        client = self._client
        if run_id is not None:
            client.update_run(run_id, status="RUNNING")
            return run_id
        if self.experiment is None:
            experiment_id = "0"
        else:
            found = client.get_experiment_by_name(self.experiment)
            experiment_id = (client.create_experiment(self.experiment) if found is None
                             else found.experiment_id)
        run = client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
        return str(run.info.run_id)

    def _already_sent(self) -> dict[str, int]:
        client, run_id = self._client, self.run_id
        latest: dict[str, int] = {}
        for key in client.get_run(run_id).data.metrics:
            history = client.get_metric_history(run_id, key)
            if history:
                latest[key] = max(metric.step for metric in history)
        return latest

    def _send(self, rows: list[Row]) -> None:
        metric = self._entities.Metric
        metrics = [metric(_name(tag), value, stamp, step)
                   for step, values, stamp in rows for tag, value in values.items()]
        for start in range(0, len(metrics), _METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[start:start + _METRICS_PER_BATCH])

    def _logged_checkpoints(self) -> set[str]:
        return {entry.path.rsplit("/", 1)[-1]
                for entry in self._client.list_artifacts(self.run_id, _CHECKPOINTS)}

    def _upload_checkpoint(self, upload: Upload) -> bool:
        where = f"{_CHECKPOINTS}/{upload.name}"
        if os.path.isdir(upload.path):
            self._client.log_artifacts(self.run_id, upload.path, f"{where}/{upload.file}")
        else:
            self._client.log_artifact(self.run_id, upload.path, where)
        return True  # returned: MLflow holds all of it

    def _holds_checkpoint(self, upload: Upload) -> bool:
        # A launch killed in the middle of a copy leaves a part of it in the store: held only
        # when every file is there with its full size.
        local: dict[str, int] = {}
        base = os.path.dirname(upload.path)
        for folder, _, files in os.walk(base):
            for file in files:
                path = os.path.join(folder, file)
                local[os.path.relpath(path, base).replace(os.sep, "/")] = os.path.getsize(path)
        local.pop("upload.json", None)  # the staged entry's record, not uploaded
        return self._artifact_sizes(f"{_CHECKPOINTS}/{upload.name}") == local

    def _artifact_sizes(self, folder: str) -> dict[str, int]:
        """Every file under the run's artifact ``folder``, by its path below it: its size."""
        sizes, todo = {}, [folder]
        while todo:
            for entry in self._client.list_artifacts(self.run_id, todo.pop()):
                if entry.is_dir:
                    todo.append(entry.path)
                else:
                    sizes[entry.path[len(folder) + 1:]] = entry.file_size
        return sizes

    def _send_settings(self, settings: dict[str, Any]) -> None:
        param = self._entities.Param
        params = [param(_param_name(key), str(value)[:_PARAM_LENGTH]) for key, value in settings.items()]
        for start in range(0, len(params), _PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=params[start:start + _PARAMS_PER_BATCH])

    def _send_metadata(self, metadata: dict[str, Any]) -> None:
        tag = self._entities.RunTag
        self._client.log_batch(self.run_id, tags=[
            tag(f"hookloop.{key}", str(value)[:_PARAM_LENGTH]) for key, value in metadata.items()])

    def _close(self, outcome: str, reason: str) -> None:
        status = _STATUS.get(outcome)
        if status is not None:  # a suspended launch leaves the run RUNNING for the relaunch
            self._client.set_terminated(self.run_id, status)
