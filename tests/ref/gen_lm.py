#!/usr/bin/python3
"""Writes the PyTorch reference fixture for the transformer blocks (embed,
decoder, lm_head): one training step of train_lm.py's ByteGPT.

Run from anywhere with Debian's python3-torch:  /usr/bin/python3 tests/ref/gen_lm.py
The model class is imported, not copied, from ../shared/bench/torch/train_lm.py
(the repository's sibling shared/ folder; it imports `common` from the same
folder), so the fixture is that file's architecture by construction.

Model: ByteGPT(d=32, layers=2, heads=4, ctx T=16), vocabulary 256, hidden 4d,
initialised by torch's defaults after torch.manual_seed(SEED); then every
LayerNorm weight and bias gets + 0.1·N(0,1) so their gradients and their use
in the forward are exercised (a default LN is the identity affine map).
Batch: B=3 windows of T+1 uniform random bytes from torch.Generator seeded
with DATA_SEED: x = w[:, :T], y = w[:, 1:].
Loss: F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)), the MEAN over
all B*T positions, as train_lm.py trains.

Output tests/ref/lm.bin, little-endian (about 0.56 MB):
    char magic[8] = "STRLREF1"; u32 version = 1; u32 kind = 200 (lm);
    u32 d, layers, heads, T, V, hidden, B, nparams;
    f32 params[nparams]      flat, model.state_dict() order (= expert/block.h's
                             order: tok_emb, pos_emb, per layer ln1_w ln1_b qkv_w
                             qkv_b proj_w proj_b ln2_w ln2_b fc1_w fc1_b fc2_w
                             fc2_b, then lnf_w lnf_b head_w head_b), each tensor
                             in C order of its torch shape (Linear w [out][in])
    i32 x[B*T]               input tokens
    i32 y[B*T]               targets
    f32 logits[B*T*V]
    f32 loss                 mean cross-entropy over the B*T positions
    f32 grads[nparams]       d loss / d params (of the MEAN loss), same order
    f32 emb[B*T*d]           tok_emb[x] + pos_emb (the input of layer 0)
    f32 layer_out[layers][B*T*d]   the output of each decoder layer
    f32 loss_after           the same batch's mean loss after one AdamW step
    f32 params_after[nparams] the parameters after that step
The step is torch.optim.AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
weight_decay=0) on the gradients above (t = 1, no clipping).
"""
import os
import struct
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TORCH_BENCH = os.path.join(os.path.dirname(ROOT), "shared", "bench", "torch")
sys.path.insert(0, TORCH_BENCH)
import train_lm  # noqa: E402  (ByteGPT, VOCAB)

SEED = 4242
DATA_SEED = 99
D, LAYERS, HEADS, T, B = 32, 2, 4, 16, 3
V = train_lm.VOCAB
HIDDEN = 4 * D
LR = 1e-3


def f32(t):
    return t.detach().contiguous().view(-1).to(torch.float32).numpy().astype("<f4").tobytes()


def i32(t):
    return t.contiguous().view(-1).to(torch.int32).numpy().astype("<i4").tobytes()


def main():
    torch.manual_seed(SEED)
    model = train_lm.ByteGPT(D, LAYERS, HEADS, T)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln" in name or name.startswith("ln_f."):
                p.add_(0.1 * torch.randn_like(p))
    names = list(model.state_dict().keys())
    byname = dict(model.named_parameters())
    assert names == list(byname.keys()), "state_dict holds more than the parameters"
    params = [byname[n] for n in names]
    nparams = sum(p.numel() for p in params)

    g = torch.Generator().manual_seed(DATA_SEED)
    w = torch.randint(0, V, (B, T + 1), generator=g, dtype=torch.int64)
    x, y = w[:, :T], w[:, 1:]

    model.train()
    # The forward written out step by step (= ByteGPT.forward) to keep the
    # activations between the layers.
    h = model.tok_emb(x) + model.pos_emb.weight[:T]
    acts = [h.detach().clone()]
    for blk in model.blocks:
        h = blk(h)
        acts.append(h.detach().clone())
    logits = model.head(model.ln_f(h))
    with torch.no_grad():
        assert torch.equal(logits, model(x)), "step-by-step forward differs from ByteGPT.forward"
    loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
    loss.backward()
    flat = torch.cat([p.detach().view(-1) for p in params])
    grads = torch.cat([p.grad.view(-1) for p in params])

    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    opt.step()
    with torch.no_grad():
        loss_after = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))
    flat_after = torch.cat([p.detach().view(-1) for p in params])

    path = os.path.join(HERE, "lm.bin")
    with open(path, "wb") as f:
        f.write(b"STRLREF1")
        f.write(struct.pack("<10I", 1, 200, D, LAYERS, HEADS, T, V, HIDDEN, B, nparams))
        f.write(f32(flat))
        f.write(i32(x))
        f.write(i32(y))
        f.write(f32(logits))
        f.write(struct.pack("<f", loss.item()))
        f.write(f32(grads))
        for a in acts:
            f.write(f32(a))
        f.write(struct.pack("<f", loss_after.item()))
        f.write(f32(flat_after))
    print(f"wrote {path}: {nparams} params, loss {loss.item():.6f} -> {loss_after.item():.6f} "
          f"after one AdamW step", file=sys.stderr)


if __name__ == "__main__":
    main()
