#!/usr/bin/python3
"""Writes tests/ref/optim.bin: torch.optim.AdamW and SGD(momentum) trajectories.

Run: /usr/bin/python3 tests/ref/gen_optim.py
Format (little-endian):
  "STRLREF1", u32 version = 1, u32 kind = 200, u32 n, u32 steps;
  f32 lr_adamw, beta1, beta2, eps, wd_adamw, lr_sgd, momentum, wd_sgd;
  f32 p0[n]; f32 grads[steps*n];
  f32 adamw_after[steps*n]   params after each AdamW step
  f32 sgd_after[steps*n]     params after each SGD step
"""
import os
import struct

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    torch.manual_seed(99)
    n, steps = 24, 4
    hp = dict(lr_adamw=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, wd_adamw=0.1,
              lr_sgd=0.1, momentum=0.9, wd_sgd=0.01)
    p0 = torch.randn(n)
    grads = torch.randn(steps, n)
    grads[1] *= 1e-3     # a small step, so eps and the bias corrections matter

    def run(opt_fn):
        p = torch.nn.Parameter(p0.clone())
        opt = opt_fn([p])
        out = []
        for s in range(steps):
            p.grad = grads[s].clone()
            opt.step()
            out.append(p.detach().clone())
        return torch.stack(out)

    adamw = run(lambda ps: torch.optim.AdamW(ps, lr=hp["lr_adamw"], betas=(hp["beta1"], hp["beta2"]),
                                             eps=hp["eps"], weight_decay=hp["wd_adamw"]))
    sgd = run(lambda ps: torch.optim.SGD(ps, lr=hp["lr_sgd"], momentum=hp["momentum"],
                                         weight_decay=hp["wd_sgd"]))
    with open(os.path.join(HERE, "optim.bin"), "wb") as f:
        f.write(b"STRLREF1")
        f.write(struct.pack("<4I", 1, 200, n, steps))
        f.write(struct.pack("<8f", hp["lr_adamw"], hp["beta1"], hp["beta2"], hp["eps"],
                            hp["wd_adamw"], hp["lr_sgd"], hp["momentum"], hp["wd_sgd"]))
        for t in (p0, grads, adamw, sgd):
            f.write(t.contiguous().view(-1).numpy().astype("<f4").tobytes())


if __name__ == "__main__":
    main()
