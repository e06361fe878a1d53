"""A GAN on scikit-learn's digits: two models and two optimizers, AMP and Checkpoint.

    python examples/gan.py                  # a new run in runs/gan
    python examples/gan.py --resume         # continue it after a kill (exactly)
    python examples/gan.py --epochs 40 --resume   # train it longer

The generator and its optimizer are the Loop's model and optimizer: the loop backpropagates
the generator's loss and steps them. The discriminator and its optimizer are handed to the
loop with ``state=``, so every checkpoint holds them and a killed run resumes both, with the
same data order and the same noise, as if it had never stopped. The discriminator is updated
inside ``forward=``, first, as DCGAN does: on the real batch and on a detached fake one.
Then the generator's loss is computed against the updated discriminator. Everything runs
under ``AMP(torch.bfloat16)`` autocast, the discriminator's backward included (bfloat16
needs no loss scaling). No download: the 1,797 8x8 digits ship inside scikit-learn.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop
from hookloop.callbacks import AMP, Checkpoint

NOISE = 16


def digits(batch_size: int = 64) -> DataLoader:
    """The digit images as 64-pixel vectors in [-1, 1] (the generator ends with tanh)."""
    images = torch.tensor(load_digits().images, dtype=torch.float32).reshape(-1, 64) / 8.0 - 1.0
    return DataLoader(TensorDataset(images, torch.zeros(len(images))), batch_size=batch_size,
                      shuffle=True, generator=torch.Generator().manual_seed(0), drop_last=True)


def networks() -> tuple[nn.Module, nn.Module]:
    generator = nn.Sequential(nn.Linear(NOISE, 128), nn.ReLU(), nn.Linear(128, 64), nn.Tanh())
    discriminator = nn.Sequential(nn.Linear(64, 128), nn.LeakyReLU(0.2), nn.Linear(128, 1))
    return generator, discriminator


def adversarial(generator: nn.Module, discriminator: nn.Module,
                opt_d: torch.optim.Optimizer):
    """The loop's forward: update the discriminator, then return the generator's loss."""

    def forward(loop: Loop, batch: tuple[torch.Tensor, torch.Tensor]):
        real = batch[0]
        fake = generator(torch.randn(len(real), NOISE, device=real.device))
        ones = torch.ones(len(real), 1, device=real.device)
        zeros = torch.zeros(len(real), 1, device=real.device)
        if loop.state.training:  # validation and predict only look
            opt_d.zero_grad(set_to_none=True)
            loss_d = (F.binary_cross_entropy_with_logits(discriminator(real), ones)
                      + F.binary_cross_entropy_with_logits(discriminator(fake.detach()), zeros))
            loss_d.backward()
            opt_d.step()
        # The generator wants its fakes taken for real by the updated discriminator. Its
        # backward also fills the discriminator's .grad; opt_d.zero_grad() clears it.
        return fake, F.binary_cross_entropy_with_logits(discriminator(fake), ones)

    return forward


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20, help="epochs of the run in all")
    parser.add_argument("--dir", default="runs/gan", help="the checkpoint directory")
    parser.add_argument("--resume", action="store_true", help="continue the run in --dir")
    parser.add_argument("--every-n-steps", type=int, default=10, help="checkpoint cadence")
    parser.add_argument("--device", default=None, help="cpu, cuda... (default: CUDA if any)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    generator, discriminator = networks()
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999))
    loop = Loop(generator, opt_g, digits(), forward=adversarial(generator, discriminator, opt_d),
                callbacks=[AMP(torch.bfloat16),
                           Checkpoint(args.dir, every_n_steps=args.every_n_steps,
                                      resume=args.resume)],
                device=args.device, state={"discriminator": discriminator, "opt_d": opt_d})
    discriminator.to(loop.device)  # the loop moves its model; state= objects stay where they are
    state = loop.fit(args.epochs)
    with torch.no_grad():
        fakes = generator(torch.randn(256, NOISE, device=loop.device))
        fooled = (discriminator(fakes) > 0).float().mean().item()
    print(f"step {state.step}  generator loss {state.metrics.get('train_loss', float('nan')):.4f}"
          f"  fakes taken for real: {fooled:.2f}", flush=True)
    return state.metrics


if __name__ == "__main__":
    main()
