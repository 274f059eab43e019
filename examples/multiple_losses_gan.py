"""Several losses and optimizers: a GAN with one loss scaler per loss (`num_losses=3`, `loss_id=...`).

Run:  python examples/multiple_losses_gan.py [--opt-level O2] [--steps 300]

The discriminator's loss on real data, its loss on generated data and the generator's loss have gradients of
very different sizes. With `num_losses=3` each has its own dynamic loss scale, so an overflow in one does not
shrink the scale of the others; `loss_id` picks the scaler. Both models and both optimizers go through one
`amp.initialize` call, which returns them in the shape it was given. The generator learns to produce points of
a 2-D Gaussian centred at (2, -1).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from ampinit import amp

CENTRE = torch.tensor([2.0, -1.0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O4", "O5"])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()

    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 32), nn.LeakyReLU(0.2), nn.Linear(32, 2))
    discriminator = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999))
    [generator, discriminator], [opt_g, opt_d] = amp.initialize(
        [generator, discriminator], [opt_g, opt_d], opt_level=args.opt_level, num_losses=3, verbosity=0
    )
    bce = nn.BCEWithLogitsLoss()
    ones, zeros = torch.ones(128, 1), torch.zeros(128, 1)

    for _ in range(args.steps):
        real = CENTRE + 0.5 * torch.randn(128, 2)
        fake = generator(torch.randn(128, 4))

        opt_d.zero_grad()
        loss_real = bce(discriminator(real), ones)
        with amp.scale_loss(loss_real, opt_d, loss_id=0) as scaled:
            scaled.backward()
        loss_fake = bce(discriminator(fake.detach()), zeros)
        with amp.scale_loss(loss_fake, opt_d, loss_id=1) as scaled:
            scaled.backward()
        opt_d.step()

        opt_g.zero_grad()
        loss_g = bce(discriminator(fake), ones)
        with amp.scale_loss(loss_g, opt_g, loss_id=2) as scaled:
            scaled.backward()
        opt_g.step()

    with torch.no_grad():
        mean = generator(torch.randn(4096, 4)).float().mean(dim=0)
    stats = amp.stats()
    print("loss scales (D real, D fake, G): " + ", ".join(f"{scale:g}" for scale in stats.loss_scales))
    print(f"optimizer steps {stats.steps}, skipped {stats.skipped_steps}")
    print(f"generated mean ({mean[0]:.3f}, {mean[1]:.3f}), target ({CENTRE[0]:.1f}, {CENTRE[1]:.1f})")
    amp.deinitialize()


if __name__ == "__main__":
    main()
