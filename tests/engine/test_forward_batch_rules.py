"""Loop(inputs=..., targets=...): pair-style training for mapping batches, checked against
the same math by hand (torch.equal), and predict's dtype and unlabeled data (issue 19
items 2 and 3)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from hookloop import Callback, ConfigurationError, Loop
from hookloop.callbacks import AMP, Metrics


def _batches(count: int = 4, labeled: bool = True) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        batch = {"image": torch.randn(6, 5, generator=generator)}
        if labeled:
            batch["label"] = torch.randint(0, 3, (6,), generator=generator)
        batches.append(batch)
    return batches


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


@pytest.mark.parametrize("inputs, targets", [("image", "label"),
                                             (lambda b: b["image"], lambda b: b["label"])],
                         ids=["keys", "functions"])
def test_dict_batches_train_pair_style_like_the_same_math_by_hand(inputs, targets) -> None:
    model = _model()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(),
                loss_fn=F.cross_entropy, inputs=inputs, targets=targets, device="cpu")
    loop.fit(2)
    by_hand = _model()
    optimizer = torch.optim.SGD(by_hand.parameters(), lr=0.1)
    for _ in range(2):
        for batch in _batches():
            F.cross_entropy(by_hand(batch["image"]), batch["label"]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), by_hand.parameters()))


def test_metrics_read_the_targets_rule() -> None:
    model = _model()
    accuracy = Metrics(acc=lambda outputs, targets: (outputs.argmax(-1) == targets).float().mean())
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(),
                val_data=_batches(2), loss_fn=F.cross_entropy, inputs="image", targets="label",
                callbacks=[accuracy], device="cpu")
    metrics = loop.fit(1).metrics
    with torch.no_grad():
        right = sum(int((model(b["image"]).argmax(-1) == b["label"]).sum()) for b in _batches(2))
    assert metrics["val_acc"] == pytest.approx(right / 12, abs=1e-6)  # float32 means


class DictDataset(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"image": torch.full((5,), float(index)), "label": torch.tensor(index % 3)}


@pytest.mark.parametrize("data", [_batches(), DataLoader(DictDataset(), batch_size=4)],
                         ids=["list", "dataloader"])
def test_dict_batches_with_loss_fn_and_no_rule_fail_before_the_first_batch(data) -> None:
    class FirstBatch(Callback):
        batches = 0

        def on_batch_start(self, loop):
            FirstBatch.batches += 1

    model = _model()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                loss_fn=F.cross_entropy, callbacks=[FirstBatch()], device="cpu")
    before = torch.get_rng_state()
    with pytest.raises(ConfigurationError, match=r"mapping \(keys 'image', 'label'\).*"
                       r"inputs='<key>', targets='<key>'"):
        loop.fit(1)
    assert FirstBatch.batches == 0
    assert torch.equal(torch.get_rng_state(), before)


def test_a_rule_naming_a_missing_key_lists_the_keys() -> None:
    model = _model()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(),
                loss_fn=F.cross_entropy, inputs="pixels", targets="label", device="cpu")
    with pytest.raises(ConfigurationError, match=r"Loop inputs='pixels': the batch has no such "
                       r"key; its keys are 'image', 'label'"):
        loop.fit(1)


@pytest.mark.parametrize("bad", [3.5, "", nn.Linear], ids=["float", "empty", "class"])
def test_bad_rules_are_refused_when_the_loop_is_built(bad) -> None:
    model = _model()
    with pytest.raises(ConfigurationError, match="Loop inputs must be"):
        Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(),
             loss_fn=F.cross_entropy, inputs=bad, device="cpu")


# ----------------------------------------------------------------------- predict
def test_predict_under_bf16_autocast_returns_float32_unless_asked() -> None:
    model = _model()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(),
                loss_fn=F.cross_entropy, inputs="image", targets="label",
                callbacks=[AMP(torch.bfloat16)], device="cpu")
    outputs = loop.predict(_batches(2))
    assert outputs.dtype == torch.float32 and outputs.shape == (12, 3)
    outputs.numpy()  # bfloat16 would fail here
    assert loop.predict(_batches(2), dtype=None).dtype == torch.bfloat16
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = torch.cat([model(b["image"]) for b in _batches(2)]).float()
    assert torch.equal(outputs, expected)


def test_predict_on_unlabeled_data_with_the_inputs_rule_or_its_own_forward() -> None:
    model = _model()

    def needs_labels(loop, batch):
        outputs = loop.model(batch["image"])
        return outputs, F.cross_entropy(outputs, batch["label"])

    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(),
                forward=needs_labels, device="cpu")
    unlabeled = _batches(2, labeled=False)
    with torch.no_grad():
        expected = torch.cat([model(b["image"]) for b in unlabeled])
    mine = loop.predict(unlabeled, forward=lambda loop, batch: loop.model(batch["image"]))
    assert torch.equal(mine, expected)
    by_rule = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(),
                   forward=needs_labels, inputs="image", device="cpu")
    assert torch.equal(by_rule.predict(unlabeled), expected)


# ------------------------------------------- predict: dtype and inputs (issue 25, item 9)
def _pair_loop() -> tuple[Loop, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    data = [(torch.randn(4, 5), torch.randint(0, 3, (4,))) for _ in range(2)]
    return Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                loss_fn=F.cross_entropy, device="cpu"), data


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8, "int64", 3])
def test_predict_refuses_a_dtype_that_is_not_floating(dtype) -> None:
    """torch.int64 truncated float outputs to integers silently; "int64" and 3 are not
    the name of a floating dtype either."""
    loop, data = _pair_loop()
    with pytest.raises(ConfigurationError, match=r"predict dtype .*floating dtype"):
        loop.predict(data, dtype=dtype)


@pytest.mark.parametrize(("name", "dtype"), [("float16", torch.float16), ("bfloat16", torch.bfloat16),
                                             ("torch.float64", torch.float64), ("float32", torch.float32)])
def test_predict_takes_the_name_of_a_floating_dtype(name: str, dtype: torch.dtype) -> None:
    """"float16" was taken for a device name ("Invalid device string"); it is the dtype."""
    loop, data = _pair_loop()
    expected = torch.cat([loop.model(inputs) for inputs, _ in data]).detach().to(dtype)
    assert torch.equal(loop.predict(data, dtype=name), expected)


@pytest.mark.parametrize(("convert", "expected"), [
    (lambda inputs: inputs.double(), r"input is torch\.float64 but the model's parameters are "
                                     r"torch\.float32.*inputs\.to\(torch\.float32\).*"
                                     r"model\.to\(torch\.float64\)"),
    (lambda inputs: inputs.numpy(), r"input is a numpy\.ndarray \(float32\), not a tensor.*"
                                    r"torch\.from_numpy\(array\)\.float\(\).*DataLoader"),
    (lambda inputs: inputs.double().numpy(), r"numpy\.ndarray \(float64\)"),
])
def test_predict_names_the_dtype_or_type_of_inputs_the_model_cannot_take(convert, expected) -> None:
    """Instead of torch's "mat1 and mat2 must have the same dtype" or "must be Tensor, not
    numpy.ndarray"; the error keeps torch's as its cause."""
    loop, data = _pair_loop()
    for batches in ([(convert(inputs), targets) for inputs, targets in data],
                    [convert(inputs) for inputs, _ in data]):  # pairs, and inputs alone
        with pytest.raises(ConfigurationError, match=expected) as raised:
            loop.predict(batches)
        assert isinstance(raised.value.__cause__, (RuntimeError, TypeError))


def test_training_on_float64_data_names_the_dtype_too() -> None:
    loop, data = _pair_loop()
    loop.train_data = [(inputs.double(), targets) for inputs, targets in data]
    with pytest.raises(ConfigurationError, match=r"torch\.float64 but the model's parameters"):
        loop.fit(1)


def test_a_model_that_converts_its_inputs_itself_is_not_refused() -> None:
    """Asked only after the model raised: float64 inputs to a model that casts them work."""
    torch.manual_seed(0)
    inner = nn.Linear(5, 3)

    class Casting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return self.inner(inputs.float())

    model = Casting()
    data = [(torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,)))]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                loss_fn=F.cross_entropy, device="cpu")
    assert torch.equal(loop.predict(data), inner(data[0][0].float()).detach())


@pytest.mark.parametrize("where", ["model", "loss"])
def test_out_of_memory_stays_what_it_is_whatever_the_batch_looks_like(where: str) -> None:
    """The inputs' and targets' advice is for errors the batch caused: a device out of memory
    in a model that casts its float64 inputs itself, or in a loss given float targets, stays
    torch's OutOfMemoryError (a script that catches it to retry smaller must see it)."""
    torch.manual_seed(0)
    inner = nn.Linear(5, 3)

    class Casting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            if where == "model":
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
            return self.inner(inputs.float())

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")

    model = Casting()
    data = [(torch.randn(4, 5, dtype=torch.float64), torch.zeros(4))]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                loss_fn=loss_fn, device="cpu")
    with pytest.raises(torch.cuda.OutOfMemoryError, match="Tried to allocate") as caught:
        loop.fit(1)
    assert not isinstance(caught.value, ConfigurationError)


@pytest.mark.parametrize(("loss_fn", "soft"), [
    (F.cross_entropy, True), (nn.CrossEntropyLoss(), True),
    (lambda outputs, targets: F.nll_loss(outputs.log_softmax(1), targets), False)])
def test_float_class_labels_for_a_cross_entropy_loss_are_told_to_be_long(loss_fn, soft) -> None:
    """Issue 25, item 15: torch says "expected target dtype to be Long or Byte, but got
    Float"; the error names the shapes and targets.long()."""
    loop, data = _pair_loop()
    loop.loss_fn = loss_fn
    loop.train_data = [(inputs, targets.float()) for inputs, targets in data]
    with pytest.raises(ConfigurationError, match=r"targets are torch\.float32 of shape \(4,\), "
                                                 r"class indices for outputs of shape \(4, 3\).*"
                                                 r"targets\.long\(\)") as raised:
        loop.fit(1)
    assert isinstance(raised.value.__cause__, RuntimeError)
    if soft:  # class probabilities of the outputs' shape: soft labels train
        loop.train_data = [(inputs, F.one_hot(targets, 3).float()) for inputs, targets in data]
        loop.fit(1)
