#!/usr/bin/python3
"""Fashion-MNIST through a swarm's remote stages, with local PyTorch parts.

    local Linear(784,512) -> RemoteStages(swarm, "fmnist-mlp", range(1, 5))
                          -> local LayerNorm(512) + Linear(512,10)

The four remote ResFFN stages train on the peers that hold them (their
own AdamW, stepping at their target batch); the local parts train here
with torch.optim.AdamW. Prints the loss as it goes and the test accuracy
at the end (--json: one JSON line).

    python3 python/examples/fmnist_remote.py --initial-peers 127.0.0.1:4000/<id>
    python3 python/examples/fmnist_remote.py            # starts its own loopback swarm

Without --initial-peers it starts a bootstrap node and two peers (stages
1-2 and 3-4) with the `starling` binary ($STARLING, or the checkout's
build), and stops them at exit.
"""
import argparse
import gzip
import json
import os
import struct
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # a checkout's python/, when not installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import starling  # noqa: E402
import starling.local  # noqa: E402

DATA_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist
MEAN, STD = 0.286041, 0.353024                   # routing/data.h, the PyTorch baselines'


def _read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    magic, = struct.unpack(">I", data[:4])
    ndims = magic & 0xFF
    if magic >> 8 != 0x08 or ndims not in (1, 3):
        raise ValueError("%s: not an IDX file of unsigned bytes" % path)
    dims = struct.unpack(">" + "I" * ndims, data[4:4 + 4 * ndims])
    body = data[4 + 4 * ndims:]
    n = 1
    for d in dims:
        n *= d
    if len(body) != n:
        raise ValueError("%s: %d bytes of data, want %d" % (path, len(body), n))
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).view(*dims)


def load_fmnist(split="train", data_dir=DATA_DIR, limit=None):
    """(x float32 (N, 784) normalised, y int64 (N,)) of Fashion-MNIST's
    train or t10k split."""
    pre = "train" if split == "train" else "t10k"

    def path(kind):
        p = os.path.join(data_dir, "%s-%s" % (pre, kind))
        return p + ".gz" if os.path.exists(p + ".gz") else p

    try:
        images = _read_idx(path("images-idx3-ubyte"))
        labels = _read_idx(path("labels-idx1-ubyte"))
    except FileNotFoundError as e:
        raise SystemExit("Fashion-MNIST not found in %s (%s): apt-get install dataset-fashion-mnist, "
                         "or pass --data DIR" % (data_dir, e.filename))
    if limit:
        images, labels = images[:limit], labels[:limit]
    x = (images.reshape(len(images), -1).float() / 255.0 - MEAN) / STD
    return x.contiguous(), labels.long()


class Net(torch.nn.Module):
    """Local input projection, the remote body, a local head."""

    def __init__(self, swarm):
        super().__init__()
        self.inp = torch.nn.Linear(784, 512)
        self.body = starling.RemoteStages(swarm, "fmnist-mlp", range(1, 5))
        self.norm = torch.nn.LayerNorm(512)
        self.head = torch.nn.Linear(512, 10)

    def forward(self, x):
        return self.head(self.norm(self.body(self.inp(x))))


def evaluate(net, x, y, batch=256):
    net.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            out = net(x[i:i + batch])
            loss += F.cross_entropy(out, y[i:i + batch], reduction="sum").item()
            correct += (out.argmax(1) == y[i:i + batch]).sum().item()
    net.train()
    return correct / len(x), loss / len(x)


def train(net, x, y, batch=64, lr=1e-3, epochs=1, seed=0, log=None, on_step=None):
    """Trains net's local parts with AdamW (the remote stages train on
    their peers); returns (losses per step, training seconds)."""
    opt = torch.optim.AdamW([p for p in net.parameters()], lr=lr)
    g = torch.Generator().manual_seed(seed)
    losses = []
    t0 = time.monotonic()
    net.train()
    for ep in range(epochs):
        order = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), batch):
            idx = order[i:i + batch]
            loss = F.cross_entropy(net(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if on_step:
                on_step(len(losses))
            if log and (len(losses) % 20 == 0 or i + batch >= len(x)):
                log("epoch %d step %d: loss %.4f" % (ep + 1, len(losses), sum(losses[-20:]) / len(losses[-20:])))
    return losses, time.monotonic() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--initial-peers", help="the swarm's address string(s); default: start a loopback swarm")
    ap.add_argument("--swarm-key", help="swarm key file of a private swarm")
    ap.add_argument("--samples", type=int, default=6000, help="training samples (default 6000)")
    ap.add_argument("--test-samples", type=int, default=2000, help="test samples (default 2000)")
    ap.add_argument("--batch", type=int, default=64, help="rows per step (default 64)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3, help="the local parts' AdamW learning rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=DATA_DIR, help="Fashion-MNIST directory (default %s)" % DATA_DIR)
    ap.add_argument("--starling", help="the starling binary for a self-started swarm (default $STARLING)")
    ap.add_argument("--json", action="store_true", help="print one JSON line at the end")
    a = ap.parse_args(argv)
    torch.manual_seed(a.seed)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if a.json else (lambda s: print(s, flush=True))

    xtr, ytr = load_fmnist("train", a.data, a.samples)
    xte, yte = load_fmnist("test", a.data, a.test_samples)
    local = None
    peers = a.initial_peers
    if not peers:
        local = starling.local.LocalSwarm(a.starling)
        peers = local.start_bootstrap()
        local.start_peer("a", "1-2")
        local.start_peer("b", "3-4")
        log("started a loopback swarm: %s (logs in %s)" % (peers, local.dir))
    try:
        with starling.Swarm(peers, swarm_key=a.swarm_key, seed=a.seed + 1) as swarm:
            net = Net(swarm)
            losses, secs = train(net, xtr, ytr, a.batch, a.lr, a.epochs, a.seed, log)
            acc, tloss = evaluate(net, xte, yte)
            c = net.body.counters
            res = {"samples": len(xtr) * a.epochs, "samples_per_s": round(len(xtr) * a.epochs / secs, 1),
                   "test_acc": round(acc, 6), "test_loss": round(tloss, 6), "first_loss": round(losses[0], 6),
                   "last_loss": round(sum(losses[-10:]) / len(losses[-10:]), 6), "calls": c["calls"],
                   "retries": c["retries"], "elapsed_s": round(secs, 3)}
            if a.json:
                print(json.dumps(res), flush=True)
            else:
                log("test accuracy %.4f (test loss %.4f), %.1f training samples/s, %d stage calls, %d retries"
                    % (acc, tloss, res["samples_per_s"], c["calls"], c["retries"]))
    finally:
        if local:
            local.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
