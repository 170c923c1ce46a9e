#!/usr/bin/python3
"""Writes the PyTorch reference fixtures for the expert blocks and the loss.

Run from anywhere with Debian's python3-torch:  /usr/bin/python3 tests/ref/gen_blocks.py
Outputs (little-endian, committed; a few KB each) next to this script:

  <block>.bin   block fixtures (linear, resffn, head):
      char magic[8] = "STRLREF1"; u32 version = 1;
      u32 kind (1 linear, 2 resffn, 3 head), in, out, hidden, B, nparams;
      f32 params[nparams]   flat, in expert/block.h order (= torch state_dict order)
      f32 inp[B*in], dout[B*out], out[B*out], dinp[B*in], dparams[nparams]
  The loss is L = sum(out * dout), so dout is dL/dout; dparams are the
  gradients of that summed loss, which is what expert_block_backward
  accumulates.

  crossentropy.bin:
      "STRLREF1", u32 version = 1, u32 kind = 100, u32 B, u32 V;
      f32 logits[B*V]; i32 targets[B]; f32 losses[B], dlogits[B*V]
  with dlogits the gradient of the SUM of the losses.
"""
import os
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))


class ResFFN(nn.Module):   # = ../shared/bench/torch/common.py ResFFN
    def __init__(self, d, hidden):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Head(nn.Module):     # = common.py Head
    def __init__(self, d, n_out):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, n_out)

    def forward(self, x):
        return self.fc(self.ln(x))


def f32(t):
    return t.detach().contiguous().view(-1).to(torch.float32).numpy().tobytes()


def block_fixture(name, kind, mod, n_in, n_out, hidden, B):
    # Make LN weights/biases non-trivial so their gradients are exercised.
    with torch.no_grad():
        for n, p in mod.named_parameters():
            if n.startswith("ln."):
                p.add_(0.1 * torch.randn_like(p))
    params = [p for _, p in mod.named_parameters()]
    x = (torch.randn(B, n_in) * 1.5 + 0.3).requires_grad_(True)
    dout = torch.randn(B, n_out)
    y = mod(x)
    (y * dout).sum().backward()
    flat = torch.cat([p.detach().view(-1) for p in params])
    dflat = torch.cat([p.grad.view(-1) for p in params])
    with open(os.path.join(HERE, name + ".bin"), "wb") as f:
        f.write(b"STRLREF1")
        f.write(struct.pack("<7I", 1, kind, n_in, n_out, hidden, B, flat.numel()))
        for t in (flat, x, dout, y, x.grad, dflat):
            f.write(f32(t))


def ce_fixture(B=5, V=7):
    logits = (torch.randn(B, V) * 3).requires_grad_(True)
    targets = torch.randint(0, V, (B,))
    losses = F.cross_entropy(logits, targets, reduction="none")
    losses.sum().backward()
    with open(os.path.join(HERE, "crossentropy.bin"), "wb") as f:
        f.write(b"STRLREF1")
        f.write(struct.pack("<4I", 1, 100, B, V))
        f.write(f32(logits))
        f.write(targets.to(torch.int32).numpy().tobytes())
        f.write(f32(losses))
        f.write(f32(logits.grad))


def main():
    torch.manual_seed(1234)
    block_fixture("linear", 1, nn.Linear(12, 8), 12, 8, 0, 3)
    block_fixture("resffn", 2, ResFFN(8, 32), 8, 8, 32, 4)
    block_fixture("head", 3, Head(8, 5), 8, 5, 0, 3)
    ce_fixture()
    print("wrote fixtures to", HERE, file=sys.stderr)


if __name__ == "__main__":
    main()
