"""Text classification the Hugging Face way: mapping batches and a model that returns its loss.

    python examples/text_classification.py                     # 4 epochs, a few seconds
    python examples/text_classification.py --max-steps 10      # a quick smoke run
    python examples/text_classification.py --checkpoint-dir ckpt/text   # save; rerun resumes

Batches are dicts with ``input_ids``, ``attention_mask`` and ``labels``; the model is
called as ``model(**batch)`` and returns ``{"loss": ..., "logits": ...}``, like a
``transformers`` model, so the loop needs no ``loss_fn`` and no adapter. The stack is the
``finetune`` preset: bf16 autocast, clipping at 1.0, warmup then linear decay. A
``transformers`` model drops in unchanged (``AutoModelForSequenceClassification`` with a
tokenizer's ``DataCollatorWithPadding``); here a tiny transformer trains from scratch on
generated sentences so nothing is downloaded.

The task: a sentence of 4 to 24 random tokens is positive when it holds more "positive"
tokens (ids 2-9) than "negative" ones (ids 10-17); the other ids are neutral words.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from hookloop import Loop, presets

VOCABULARY, PAD = 64, 0


def generate(count: int, seed: int) -> list[dict[str, Any]]:
    """Sentences of different lengths (no padding yet) with their labels."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(count):
        length = int(torch.randint(4, 25, (), generator=generator))
        tokens = torch.randint(2, VOCABULARY, (length,), generator=generator)
        positive = int(((tokens >= 2) & (tokens < 10)).sum())
        negative = int(((tokens >= 10) & (tokens < 18)).sum())
        if positive == negative:  # no ties: make it positive with one more positive word
            tokens[0], positive = 2, positive + 1
        examples.append({"input_ids": tokens, "labels": int(positive > negative)})
    return examples


def collate(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Pad to the longest sentence of the batch and build the attention mask."""
    longest = max(len(example["input_ids"]) for example in examples)
    input_ids = torch.full((len(examples), longest), PAD, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for row, example in enumerate(examples):
        input_ids[row, : len(example["input_ids"])] = example["input_ids"]
        attention_mask[row, : len(example["input_ids"])] = 1
    labels = torch.tensor([example["labels"] for example in examples])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class TinyTransformerClassifier(nn.Module):
    """Embeddings, one transformer encoder layer, masked mean pooling, a linear head."""

    def __init__(self, classes: int = 2, width: int = 32, longest: int = 32) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCABULARY, width, padding_idx=PAD)
        self.positions = nn.Embedding(longest, width)
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=64, dropout=0.1,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.tokens(input_ids) + self.positions(positions)
        hidden = self.encoder(hidden, src_key_padding_mask=attention_mask == 0)
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        logits = self.head(pooled)
        result = {"logits": logits}
        if labels is not None:
            result["loss"] = F.cross_entropy(logits.float(), labels)
        return result


def accuracy(outputs: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    return (outputs["logits"].argmax(dim=-1) == labels).float().mean()


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save checkpoints here; a rerun resumes the run in it")
    parser.add_argument("--tensorboard", default="runs/text_classification",
                        help="TensorBoard log directory ('none' for no logs)")
    parser.add_argument("--no-progress", action="store_true", help="no progress display")
    parser.add_argument("--device", default=None, help="cpu, cuda... (default: CUDA if any)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    train_data = DataLoader(generate(args.train_size, seed=1), batch_size=32, shuffle=True,
                            collate_fn=collate, generator=torch.Generator().manual_seed(0))
    val_data = DataLoader(generate(500, seed=2), batch_size=128, collate_fn=collate)
    model = TinyTransformerClassifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    callbacks = presets.finetune(
        metrics={"acc": accuracy}, monitor="val_acc",
        checkpoint_dir=args.checkpoint_dir, resume=args.checkpoint_dir is not None,
        tensorboard=None if args.tensorboard == "none" else args.tensorboard,
        progress=not args.no_progress)
    # No loss_fn: the batch is a mapping, so the loop calls model(**batch) and reads "loss".
    loop = Loop(model, optimizer, train_data, val_data=val_data, callbacks=callbacks,
                device=args.device)
    state = loop.fit(args.epochs, max_steps=args.max_steps)
    if "val_acc" in state.metrics:
        print(f"epoch {state.epoch + 1}/{args.epochs}  step {state.step}  "
              f"val_loss {state.metrics['val_loss']:.4f}  val_acc {state.metrics['val_acc']:.4f}")
    else:
        print(f"stopped at step {state.step} ({loop.stop_reason or 'nothing left to train'})")
    return state.metrics


if __name__ == "__main__":
    main()
