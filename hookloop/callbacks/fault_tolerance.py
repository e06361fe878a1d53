"""Training that survives a dead replica group, on torchft: quorum, all-reduce and commit
per step, recovery of a restarted group from a live peer, and every shard trained once."""

from __future__ import annotations

import contextlib
import json
import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from hookloop import distributed
from hookloop.base.checks import check_optional_int
from hookloop.callback import Callback
from hookloop.fault_tolerance_shards import shard_data, train_window
from hookloop.errors import ConfigurationError, HookloopError
from hookloop.parallel import ft_plan
from hookloop.parallel.ft_goodput import Goodput

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["FaultTolerance"]

_STATE_NAME = "fault_tolerance"  # its part of the run's state, in Loop.extra_state


class _RunRecord:
    """The fault-tolerance part of the run's state: torchft's step, the ledger, goodput."""

    def __init__(self) -> None:
        self.ledger = ft_plan.Ledger()
        self.goodput = Goodput()
        self.torchft_step = 0
        self.restored = False
        self.from_peer = False  # set while a live peer's state is applied

    def state_dict(self) -> dict[str, Any]:
        return {"torchft_step": self.torchft_step, "ledger": self.ledger.state_dict(),
                "goodput": self.goodput.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.torchft_step = int(state["torchft_step"])
        self.ledger.load_state_dict(state["ledger"])
        if "goodput" in state:  # the time since the snapshot: a transfer, or a relaunch
            self.goodput.load_state_dict(state["goodput"],
                                         gap="healing" if self.from_peer else "restart")
            # the peer counts this join after its snapshot: count it in this copy too
            self.goodput.count("joined" if self.from_peer else "resumed")
        self.restored = True


class FaultTolerance(Callback):
    """Data-parallel training over replica groups that survives a dead group, on torchft.

    Each replica group is one process (start them with ``hookloop run --groups N``, or by
    hand with the variables of `hookloop.parallel.ft_plan`), or a torchrun of several with
    ``FSDP(state_dict="sharded")`` before this callback (HSDP: FSDP inside the group, each
    rank all-reducing its gradient shards with the same-rank rank of the other groups, and
    taking its own shards from that rank when its group heals); a torchft lighthouse forms
    a quorum of the live groups at every step. Per step, after the loop's backward:

    * the quorum of live groups (the first one, at setup, waits for every group of a new
      run, so a run starts with all of them);
    * when groups are missing, each missing group's shard of the step is trained by a live
      group (by accumulation), so every step trains the whole global batch, each shard once;
    * the gradients are all-reduced through torchft's manager (a sum, divided by
      ``groups``: with no fault exactly what plain DDP of ``groups`` ranks computes);
    * the optimizer steps only when torchft's ``should_commit`` agrees; a failed step
      (a peer died inside the all-reduce) is redone with the new quorum, from the step's
      own gradients, before the loop goes on.

    A restarted group takes the whole run's state (`Loop.state_dict`: weights, optimizer,
    schedule, callbacks' states, position, RNG) from a live peer at its setup, and trains
    the step its peers are at; a ``Checkpoint(resume=True)`` in its stack leaves that fit
    alone (the live state wins). With no live peer, it continues from what ``Checkpoint``
    restored (torchft's step is in the run's state), or, when nothing was restored and
    ``run_dir`` shows that the run had committed steps, stops with an error before the
    first batch: never from step 0 with fresh weights.

    Give every group the same `CSVLogger` and `TensorBoard`: after each commit the lowest
    group of the step's quorum is told to write the step's rows (``hold_writes``), the
    others keep them in memory, so the files hold every step once across faults; the step's
    ``loop.state.loss`` is the loss of the whole global batch (all-reduced with the
    gradients), the same in every group.

    Every committed step is in `ledger`: ``[step, epoch, batch, group of shard 0, ...]``.
    Where the run's wall time went is in `goodput` (`hookloop.parallel.ft_goodput`), kept
    in the run's state across relaunches and printed at the end of each fit.

    Args:
        groups: How many replica groups the run has (default: ``HOOKLOOP_FT_GROUPS``).
        group: This process's group, ``0 .. groups-1`` (default: ``HOOKLOOP_FT_GROUP``).
        lighthouse: The lighthouse's address (default: ``TORCHFT_LIGHTHOUSE``).
        run_dir: A directory every group can write, where each records its last committed
            step (default: ``HOOKLOOP_FT_RUN_DIR``; None: no check against a silent restart).
        timeout: Seconds a collective, the commit vote or a transfer from a peer may take:
            the time to detect a peer that hangs (a dead one is noticed at once inside a
            collective, and between steps after the lighthouse's heartbeat timeout,
            `hookloop.parallel.ft_plan.DEFAULT_HEARTBEAT_TIMEOUT_MS`).
        quorum_timeout: Seconds to wait for a quorum (and, at a new run's start, for every
            group to join).

    Raises:
        ConfigurationError: at setup: torchft missing (``pip install hookloop[ft]``), a
            bad group number, training data that is not a map-style DataLoader, or a group
            of several processes without ``FSDP(state_dict="sharded")`` before it.
        HookloopError: a group with no live peer, nothing restored and a run that had
            committed steps; a group left behind by its peers in the middle of a fit.

    Example:
        >>> from hookloop.callbacks import FaultTolerance
        >>> FaultTolerance(groups=2, group=0, lighthouse="http://localhost:29510").groups
        2
    """

    unique: ClassVar[bool] = True
    roles: ClassVar[tuple[str, ...]] = ("distributed",)
    state_at_boundaries = True

    def __init__(self, *, groups: int | None = None, group: int | None = None,
                 lighthouse: str | None = None, run_dir: str | None = None,
                 timeout: float = ft_plan.DEFAULT_TIMEOUT_S,
                 quorum_timeout: float = ft_plan.DEFAULT_QUORUM_TIMEOUT_S) -> None:
        groups = _from_env("groups", groups, ft_plan.ENV_GROUPS)
        group = _from_env("group", group, ft_plan.ENV_GROUP)
        groups = check_optional_int("FaultTolerance groups", groups)
        if groups is None or group is None or not 0 <= group < groups:
            raise ConfigurationError(
                f"FaultTolerance needs groups >= 1 and 0 <= group < groups, got groups="
                f"{groups!r}, group={group!r}. Pass them, or set {ft_plan.ENV_GROUPS} and "
                f"{ft_plan.ENV_GROUP} (hookloop run --groups N sets both).")
        self.groups: int = groups
        self.group: int = group
        self.lighthouse = lighthouse or os.environ.get(ft_plan.ENV_LIGHTHOUSE)
        self.run_dir = run_dir or os.environ.get(ft_plan.ENV_RUN_DIR)
        self.timeout, self.quorum_timeout = float(timeout), float(quorum_timeout)
        self._record = _RunRecord()
        self._manager: Any = None
        self._store: Any = None
        self._loop: Any = None
        self._sampler: Any = None
        self._first_quorum = self._alone = False
        self._members = 0
        self._rank, self._ranks = 0, 1  # this process in its replica group (HSDP: FSDP's)
        self._savers: list[Any] = []
        self._loggers: list[Any] = []  # callbacks with `hold_writes` (CSVLogger, TensorBoard)
        self._seen_saves: dict[int, tuple[Any, Any]] = {}
        #: Where the run's state of this fit came from, when this callback restored it (a
        #: live peer); ``Checkpoint(resume=True)`` leaves such a fit alone.
        self.restored_run: str | None = None

    def __repr__(self) -> str:
        return f"FaultTolerance(groups={self.groups}, group={self.group})"

    @property
    def ledger(self) -> list[list[int]]:
        """Per committed step ``[step, epoch, batch, group of shard 0, group of shard 1...]``."""
        return self._record.ledger.entries

    @property
    def goodput(self) -> Goodput:
        """Where the run's wall time went: seconds per bucket, and counts of faults."""
        return self._record.goodput

    @property
    def manager(self) -> Any:
        """torchft's ``Manager`` of this group (None outside a fit)."""
        return self._manager

    # ------------------------------------------------------------------- setup
    def setup(self, loop: Loop) -> None:
        if not loop.fitting or self._manager is not None:
            return
        self._record.goodput.begin()  # a run's clock starts here (a restored one goes on)
        try:
            from torchft import Manager, ProcessGroupGloo
        except ImportError as error:
            raise ConfigurationError(
                "FaultTolerance needs torchft: pip install 'hookloop[ft]' "
                f"(importing it failed: {error}).") from error
        if not self.lighthouse:
            raise ConfigurationError(
                "FaultTolerance needs the lighthouse's address: lighthouse='http://host:port' "
                f"or {ft_plan.ENV_LIGHTHOUSE} (hookloop run --groups N starts one).")
        self._group_ranks(loop)
        self._sampler = shard_data(loop, self.groups * self._ranks,
                                   self.group * self._ranks + self._rank)
        loop.extra_state[_STATE_NAME] = self._record
        self._loop, self._savers = loop, [
            callback for callback in loop.callbacks
            if hasattr(type(callback), "last_save_seconds")]
        self._loggers = [callback for callback in loop.callbacks  # rank 0's, as dispatched
                         if callable(getattr(callback, "hold_writes", None))
                         and (self._rank == 0 or not callback.rank_zero_only)]
        for logger in self._loggers:  # nothing written until a step names its writer
            logger.hold_writes(loop, True)
        if self._ranks == 1:
            self._store = torch.distributed.TCPStore("localhost", 0, is_master=True,
                                                     wait_for_workers=False)
            address, port = "localhost", self._store.port
        else:  # the group's ranks share torchrun's store (its manager server runs on rank 0)
            address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        timeout = timedelta(seconds=self.timeout)
        self._manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=self._load_from_peer,
            state_dict=self._state_for_peer, min_replica_size=1, use_async_quorum=False,
            timeout=timeout, quorum_timeout=timedelta(seconds=self.quorum_timeout),
            connect_timeout=timeout, rank=self._rank, world_size=self._ranks,
            store_addr=address, store_port=port, lighthouse_addr=self.lighthouse,
            replica_id=f"hookloop_group_{self.group}", init_sync=False)
        self._first_quorum, self._alone = True, False
        self.restored_run = None
        self._join()
        self._members = self._manager.num_participants()

    def _group_ranks(self, loop: Loop) -> None:
        """This process's rank in its replica group: one process, or (HSDP) the ranks of the
        `FSDP` that shards the model inside the group, which must be set up first."""
        self._rank, self._ranks = distributed.rank(), distributed.world_size()
        if self._ranks == 1:
            return
        fsdp = [callback for callback in loop.callbacks[:loop.callbacks.index(self)]
                if type(callback).__name__ == "FSDP"]
        if not fsdp or getattr(fsdp[0], "state_dict_layout", None) != "sharded":
            # a peer's state is taken rank by rank: each rank's own shards, no gathering
            raise ConfigurationError(
                f"FaultTolerance runs in a replica group of {self._ranks} processes, which "
                "needs FSDP(state_dict='sharded') inside the group (HSDP), listed before it: "
                "callbacks=[FSDP(state_dict='sharded'), FaultTolerance(), ...]; or launch "
                "each group as one process.")

    def _join(self) -> None:
        """The first quorum: take a live peer's state, or wait for every group of a new run;
        alone in a run under way, the decision waits for the restores (`on_fit_start`)."""
        manager, deadline = self._manager, time.monotonic() + self.quorum_timeout
        goodput = self._record.goodput
        while True:
            manager.start_quorum()
            if self.restored_run is not None or manager.num_participants() >= self.groups \
                    or manager.current_step() > 0:
                return  # healed; every group here; or a run under way with live groups
            if self._committed_steps():
                self._alone = True  # no live peer: a Checkpoint's resume, or a clear error
                return
            goodput.charge("quorum")
            if time.monotonic() > deadline:
                raise HookloopError(
                    f"FaultTolerance: only {manager.num_participants()} of {self.groups} "
                    f"replica groups joined the first quorum within {self.quorum_timeout:g} "
                    "s. Start every group (hookloop run --groups N), or raise quorum_timeout.")
            time.sleep(0.05)

    def _committed_steps(self) -> dict[str, int]:
        """Each group's last committed step, from ``run_dir`` (only those above 0)."""
        if self.run_dir is None or not os.path.isdir(self.run_dir):
            return {}
        steps = {}
        for name in os.listdir(self.run_dir):
            if name.startswith("group_") and name.endswith(".json"):
                with contextlib.suppress(OSError, ValueError, KeyError):
                    with open(os.path.join(self.run_dir, name)) as file:
                        steps[name[6:-5]] = int(json.load(file)["step"])
        return {group: step for group, step in steps.items() if step > 0}

    # -------------------------------------------------------------- recovery
    def _state_for_peer(self) -> dict[str, Any]:
        self._record.goodput.charge("healing")  # the snapshot's clock is now
        # One process: its own state. HSDP: gathered as a checkpoint is (the group's ranks
        # all serve their same-rank peer, in the same quorum, so the collective lines up).
        state: dict[str, Any] = self._loop.state_dict(gather=self._ranks > 1)
        return state

    def _load_from_peer(self, state: dict[str, Any]) -> None:
        if not self._first_quorum:
            raise HookloopError(
                f"FaultTolerance: replica group {self.group} fell behind its peers in the "
                "middle of a fit (its commit failed while theirs passed); restart it and it "
                "takes their state at setup.")
        self._loop.load_state_dict(state, source="a live peer replica group")
        self._record.from_peer = True
        # Read by Checkpoint(resume=True), whose setup comes after: the live state wins.
        self.restored_run = "a live peer replica group"

    # ------------------------------------------------------------------ events
    def on_fit_start(self, loop: Loop) -> None:
        record, manager = self._record, self._manager
        record.from_peer = False
        if self.restored_run is not None:
            if record.torchft_step != manager.current_step():
                raise HookloopError(
                    f"FaultTolerance: replica group {self.group} took step "
                    f"{manager.current_step()} from a live peer, but a later setup replaced "
                    f"the run's state with step {record.torchft_step}'s. Only FaultTolerance "
                    "may restore a group that heals from a peer.")
            return
        if not record.restored and (committed := self._committed_steps()):
            raise HookloopError(
                f"FaultTolerance: replica group {self.group} has no live peer to recover from "
                f"and no checkpoint was restored, but the run had committed steps "
                f"({committed} in {self.run_dir}). Starting at step 0 with fresh weights "
                "would silently train another run. Restart a group that has a "
                "Checkpoint(resume=True) (or start the other groups first), or delete "
                "run_dir to start the run anew.")
        manager.load_state_dict({"step": record.torchft_step, "batches_committed": 0})
        if record.restored:  # the setup's quorum had step 0: join again at the disk's step
            self._first_quorum = False

    def on_epoch_start(self, loop: Loop) -> None:
        self._sampler.set_epoch(loop.state.epoch)

    def before_step(self, loop: Loop) -> None:
        manager, state, goodput = self._manager, loop.state, self._record.goodput
        goodput.charge("training", minus=self._new_save_seconds())
        params = [p for p in loop.unwrapped_model.parameters() if p.requires_grad]
        own = [None if p.grad is None else p.grad.detach().clone() for p in params]
        own_loss = state.loss.detach().float().reshape(()) if state.loss is not None \
            else torch.zeros(())
        attempt = -1
        while True:
            attempt += 1
            if attempt:
                for param, grad in zip(params, own):
                    param.grad = None if grad is None else grad.clone()
            if not self._first_quorum:
                manager.start_quorum()
                self._charge_quorum(manager.num_participants())
            self._first_quorum = False
            plan = self._plan(manager)
            if plan is not None:
                losses = own_loss.clone()
                for shard, group in enumerate(plan):
                    if group == self.group and shard != self.group:
                        losses += train_window(loop, self._sampler, self.groups * self._ranks,
                                               shard * self._ranks + self._rank)
                goodput.charge("takeover")
                global_loss = self._all_reduce(manager, params, losses)
            step = manager.current_step()
            if manager.should_commit():
                assert plan is not None
                goodput.charge("training")
                # the step's loss over the whole global batch, the same in every group
                state.loss = global_loss.to(state.loss.dtype) if state.loss is not None \
                    else global_loss
                for logger in self._loggers:  # the lowest group of the quorum writes the logs
                    logger.hold_writes(loop, min(plan) != self.group)
                self._record.ledger.record(step, state.epoch, state.batch_idx, plan)
                self._record.torchft_step = manager.current_step()
                self._write_progress()
                return
            goodput.charge("redo")  # the attempt's work is lost: it is done again
            goodput.count("retried")
            print(f"FaultTolerance: replica group {self.group}: step {step} failed (a peer "
                  "left inside it); redoing it with the new quorum", flush=True)

    def _charge_quorum(self, members: int) -> None:
        """A quorum's time: ``detection`` when it dropped a group, ``healing`` when one came
        back, else ``quorum``."""
        goodput = self._record.goodput
        if members < self._members:
            goodput.count("dropped", self._members - members)
        elif members > self._members:
            goodput.count("joined", members - self._members)
        goodput.charge("detection" if members < self._members else
                       "healing" if members > self._members else "quorum")
        self._members = members

    def _new_save_seconds(self) -> float:
        """Seconds of the saves finished since the last call (``last_save_seconds``)."""
        seconds = 0.0
        for saver in self._savers:
            key = (getattr(saver, "last_path", None), saver.last_save_seconds)
            if key[1] is not None and self._seen_saves.get(id(saver)) != key:
                seconds += float(key[1])
            self._seen_saves[id(saver)] = key
        return seconds

    def _plan(self, manager: Any) -> list[int] | None:
        """Which group trains each shard of this step (None: the quorum failed)."""
        if manager.num_participants() >= self.groups:
            return list(range(self.groups))
        present = torch.zeros(self.groups)
        present[self.group] = 1.0
        manager.allreduce(present, reduce_op=_sum()).wait()
        if manager.errored():
            return None
        return ft_plan.assign([g for g in range(self.groups) if present[g] > 0.5], self.groups)

    def _all_reduce(self, manager: Any, params: list[torch.nn.Parameter],
                    losses: torch.Tensor) -> torch.Tensor:
        """One flat all-reduce of the gradients and of the sum of this group's shard
        losses, each divided by ``groups`` first (DDP's order of operations, so a fault-free
        run is equal to DDP's bit for bit); returns the global batch's loss."""
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = [_local(param.grad) for param in params if param.grad is not None]
        flat = torch.cat([*(grad.reshape(-1) for grad in grads),
                          losses.to(grads[0].dtype).reshape(1)]).div_(self.groups)
        manager.allreduce(flat, reduce_op=_sum()).wait()
        offset = 0
        for grad in grads:
            count = grad.numel()
            grad.copy_(flat[offset:offset + count].view_as(grad))
            offset += count
        loss = flat[-1:].detach().clone()
        if self._ranks > 1:  # the mean over the group's ranks too (the same on each)
            torch.distributed.all_reduce(loss)
            loss /= self._ranks
        return loss.reshape(())

    def _write_progress(self) -> None:
        if self.run_dir is None or self._rank != 0:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        path = os.path.join(self.run_dir, f"group_{self.group}.json")
        with open(path + ".tmp", "w") as file:
            json.dump({"step": self._record.torchft_step}, file)
        os.replace(path + ".tmp", path)

    def on_exception(self, loop: Loop, exc: BaseException) -> None:
        self._shutdown()

    def on_fit_end(self, loop: Loop) -> None:
        goodput = self._record.goodput
        goodput.charge("training", minus=self._new_save_seconds())
        print(f"FaultTolerance goodput of replica group {self.group} (the run's wall time, "
              f"across relaunches):\n{goodput.table()}", flush=True)
        self._shutdown()

    def _shutdown(self) -> None:
        if self._manager is not None:
            self._manager.shutdown(wait=False)
        self._manager = self._store = None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor, or a DTensor's local shard (its storage: written in place)."""
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def _sum() -> Any:
    from torch.distributed import ReduceOp
    return ReduceOp.SUM


def _from_env(name: str, value: int | None, variable: str) -> int | None:
    if value is not None or variable not in os.environ:
        return value
    try:
        return int(os.environ[variable])
    except ValueError as error:
        raise ConfigurationError(f"FaultTolerance {name}: {variable}="
                                 f"{os.environ[variable]!r} is not an integer.") from error

