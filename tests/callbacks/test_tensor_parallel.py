"""TensorParallel and the Mesh in one process: arguments checked, the order with FSDP and
ActivationCheckpointing refused before the first batch naming both, the sizes of a mesh
worked out. The runs on several processes are in tests/distributed/test_mesh_processes.py."""

from __future__ import annotations

import warnings

import pytest
import torch

from builders import make_loop, same_weights, two_layers
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from hookloop import CallbackOrderError, ConfigurationError
from hookloop.callbacks import DDP, FSDP, ActivationCheckpointing, Compile, TensorParallel
from hookloop.engine.grads import total_norm, unclippable
from hookloop.parallel.mesh import Mesh

PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}  # not applied in one process


def loop_with(callbacks):
    return make_loop(callbacks, model=lambda: two_layers(3, 8, 1, nn.ReLU()))


def test_tensor_parallel_after_fsdp_is_refused_naming_both() -> None:
    with pytest.raises(CallbackOrderError, match=r"FSDP.*TensorParallel.*Move TensorParallel "
                                                 r"before FSDP"):
        loop_with([FSDP(), TensorParallel(PLAN)]).fit(1)


def test_checkpointing_after_tensor_parallel_and_compile_before_it_are_refused() -> None:
    with pytest.raises(CallbackOrderError, match=r"TensorParallel.*ActivationCheckpointing"):
        loop_with([TensorParallel(PLAN), ActivationCheckpointing()]).fit(1)
    with pytest.raises(CallbackOrderError, match=r"Compile.*TensorParallel.*Move TensorParallel "
                                                 r"before Compile"):
        loop_with([Compile(backend="eager"), TensorParallel(PLAN)]).fit(1)


def test_tensor_parallel_and_ddp_conflict() -> None:
    with pytest.raises(CallbackOrderError, match="DDP cannot average DTensor gradients"):
        loop_with([TensorParallel(PLAN), DDP()]).fit(1)


def test_in_one_process_it_trains_the_plain_model_and_says_so() -> None:
    reference = loop_with([])
    reference.fit(2)
    loop = loop_with([TensorParallel(PLAN)])
    with pytest.warns(UserWarning, match="TensorParallel: not launched by torchrun"):
        loop.fit(2)
    assert same_weights(loop, reference)


@pytest.mark.parametrize(("arguments", "match"), [
    ({"plan": {}}, "TensorParallel plan"),
    ({"plan": 3}, "TensorParallel plan"),
    ({"plan": {"0": "colwise"}}, "TensorParallel plan"),
    ({"plan": PLAN, "mesh": (2, 2)}, "TensorParallel mesh"),
    ({"plan": PLAN, "state_dict": "gathered"}, "TensorParallel state_dict"),
])
def test_bad_arguments_are_refused(arguments, match) -> None:
    with pytest.raises(ConfigurationError, match=match):
        TensorParallel(**arguments)
    with pytest.raises(ConfigurationError, match="FSDP mesh"):
        FSDP(mesh="dp=2")


def test_mesh_sizes_and_the_data_parallel_coordinate() -> None:
    assert Mesh(dp_replicate=2, dp_shard="auto").sizes(8) == {
        "dp_replicate": 2, "dp_shard": 4, "tp": 1}
    assert Mesh(dp_shard=1, tp="auto").sizes(4) == {"dp_replicate": 1, "dp_shard": 1, "tp": 4}
    # (dp=2, tp=2): ranks 0, 1 are replica 0; 2, 3 replica 1
    assert [Mesh(dp_shard=2, tp=2).data_parallel(4, rank) for rank in range(4)] == [
        (2, 0), (2, 0), (2, 1), (2, 1)]
    with pytest.raises(ConfigurationError, match="does not fit 6 process"):
        Mesh(dp_shard=4, tp=1).sizes(6)
    with pytest.raises(ConfigurationError, match="at most one dimension can be 'auto'"):
        Mesh(dp_shard="auto", tp="auto")
    with pytest.raises(ConfigurationError, match="Mesh tp must be a positive int"):
        Mesh(tp=0)


def test_total_norm_combines_norms_of_several_kinds_exactly_as_one_vector() -> None:
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([4.0]), torch.tensor([12.0])]
    assert float(total_norm(grads)) == 13.0
    assert unclippable(nn.Linear(2, 2), list(nn.Linear(2, 2).parameters())) == []


def test_fsdp_refuses_tensor_parallel_weights_without_a_mesh(monkeypatch) -> None:
    """A model already split by tensor parallel (DTensor parameters) sharded by FSDP on a
    mesh of its own would put them on two unrelated meshes: refused, naming the fix."""
    from hookloop.callbacks import fsdp
    from hookloop.runfile import sharded

    model = two_layers(3, 8, 1)
    monkeypatch.setattr(sharded, "is_sharded_tensor", lambda value: isinstance(value, nn.Parameter))
    loop = make_loop([], model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigurationError, match="Pass the same hookloop.parallel.mesh.Mesh to both"):
            fsdp.FSDP()._shard(loop, model)

