"""Image-text contrastive learning with a custom ``forward``: the task adapter pattern.

    python examples/multimodal.py                    # 5 epochs, a few seconds on a CPU
    python examples/multimodal.py --max-steps 10     # a quick smoke run
    python examples/multimodal.py --checkpoint-dir ckpt/multimodal   # save; rerun resumes

A hand-written loop for a new task usually grows an adapter: ``prepare_batch`` (move the
parts of the batch), ``compute_loss`` (call the model, compute the task's loss) and
``evaluate`` (a metric). With hookloop the loop moves nested batches itself, the
``forward(loop, batch) -> (outputs, loss)`` argument is ``compute_loss``, and the metric is
a function given to ``Metrics``. Everything else (mixed precision, clipping, EMA, the
schedule, checkpoints, logs) comes from the standard preset, unchanged.

The data are generated image/text pairs: each pair comes from a hidden random vector; the
"image" is an 8x8 projection of it plus noise, the "text" 12 words drawn from a
distribution that depends on it. A dual encoder learns to match each image with its text
among the others of the batch (a CLIP-style symmetric cross-entropy).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from hookloop import Loop, presets

LATENT, WORDS, TEXT_LENGTH = 6, 48, 12


class PairDataset(Dataset):
    """Generated (image, text) pairs sharing a hidden vector; no labels."""

    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        world = torch.Generator().manual_seed(1234)  # the same "world" for every split
        to_pixels = torch.randn(LATENT, 64, generator=world)
        to_words = torch.randn(LATENT, WORDS, generator=world)
        hidden = torch.randn(count, LATENT, generator=generator)
        pixels = torch.tanh(hidden @ to_pixels / math.sqrt(LATENT))
        self.images = (pixels + 0.3 * torch.randn(count, 64, generator=generator)).view(-1, 1, 8, 8)
        word_probabilities = torch.softmax(2.0 * hidden @ to_words / math.sqrt(LATENT), dim=-1)
        self.texts = torch.multinomial(word_probabilities, TEXT_LENGTH, replacement=True,
                                       generator=generator)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> dict[str, Any]:
        # Nested like a real image-text batch: the loop moves every tensor in it.
        return {"image": self.images[index], "text": {"input_ids": self.texts[index]}}


class DualEncoder(nn.Module):
    """An image encoder and a text encoder projecting into one normalised space."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.image_encoder = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
            nn.Linear(8 * 64, 64), nn.ReLU(), nn.Linear(64, width))
        self.word_embeddings = nn.EmbeddingBag(WORDS, 64, mode="mean")
        self.text_encoder = nn.Sequential(nn.ReLU(), nn.Linear(64, width))
        self.log_temperature = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, image: torch.Tensor, text: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        image_embedding = F.normalize(self.image_encoder(image).float(), dim=-1)
        text_embedding = F.normalize(
            self.text_encoder(self.word_embeddings(text["input_ids"])).float(), dim=-1)
        return image_embedding, text_embedding


def contrastive_forward(loop: Loop, batch: dict[str, Any]) -> tuple[dict[str, torch.Tensor],
                                                                    torch.Tensor]:
    """The adapter's compute_loss: the symmetric InfoNCE loss of the batch's pairs."""
    image_embedding, text_embedding = loop.model(batch["image"], batch["text"])
    scale = loop.unwrapped_model.log_temperature.clamp(max=math.log(100)).exp()
    logits = scale * image_embedding @ text_embedding.T      # row i: image i against all texts
    matches = torch.arange(len(logits), device=logits.device)
    loss = (F.cross_entropy(logits, matches) + F.cross_entropy(logits.T, matches)) / 2
    return {"logits": logits}, loss


def recall_at_1(outputs: dict[str, torch.Tensor], targets: None) -> torch.Tensor:
    """The adapter's evaluate: how often an image's best-scoring text is its own."""
    logits = outputs["logits"]
    return (logits.argmax(dim=-1) == torch.arange(len(logits), device=logits.device)).float().mean()


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save checkpoints here; a rerun resumes the run in it")
    parser.add_argument("--tensorboard", default="runs/multimodal",
                        help="TensorBoard log directory ('none' for no logs)")
    parser.add_argument("--no-progress", action="store_true", help="no progress display")
    parser.add_argument("--device", default=None, help="cpu, cuda... (default: CUDA if any)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    train_data = DataLoader(PairDataset(2048, seed=1), batch_size=64, shuffle=True,
                            drop_last=True, generator=torch.Generator().manual_seed(0))
    val_data = DataLoader(PairDataset(640, seed=2), batch_size=64)   # recall among 64
    model = DualEncoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    callbacks = presets.standard(
        ema=0.99, metrics={"recall_at_1": recall_at_1}, monitor="val_recall_at_1",
        checkpoint_dir=args.checkpoint_dir, resume=args.checkpoint_dir is not None,
        tensorboard=None if args.tensorboard == "none" else args.tensorboard,
        progress=not args.no_progress)
    loop = Loop(model, optimizer, train_data, val_data=val_data, forward=contrastive_forward,
                callbacks=callbacks, device=args.device)
    state = loop.fit(args.epochs, max_steps=args.max_steps)
    if "val_recall_at_1" in state.metrics:
        print(f"epoch {state.epoch + 1}/{args.epochs}  step {state.step}  "
              f"val_loss {state.metrics['val_loss']:.4f}  "
              f"val_recall_at_1 {state.metrics['val_recall_at_1']:.4f} (chance: {1 / 64:.4f})")
    else:
        print(f"stopped at step {state.step} ({loop.stop_reason or 'nothing left to train'})")
    return state.metrics


if __name__ == "__main__":
    main()
