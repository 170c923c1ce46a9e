#!/usr/bin/python3
"""A byte-level language model whose middle runs on a swarm.

    local token + position embedding (d 256, context 128)
      -> RemoteStages(swarm, "tiny-lm", 1)     (two pre-LN decoder layers)
      -> local LayerNorm(256) + Linear(256, 256)

trained on the fortunes corpus (Debian's fortunes and fortunes-min, as
`starling train --model tiny-lm` reads it) or the bytes of --data FILE,
with next-byte cross-entropy at every position. The remote stage trains
on its peers (their own AdamW, stepping at their target batch); the local
parts train here. Prints the loss of every step.

    python3 python/examples/lm_remote.py --initial-peers 127.0.0.1:4000/<id>
    python3 python/examples/lm_remote.py            # starts its own loopback swarm

Without --initial-peers it starts a bootstrap node and one peer holding
tiny-lm's stage 1, and stops them at exit.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # a checkout's python/, when not installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import starling  # noqa: E402
import starling.local  # noqa: E402

FORTUNE_DIR = "/usr/share/games/fortunes"
CONTEXT, DIM, VOCAB = 128, 256, 256


def load_corpus(path=None):
    """The corpus bytes: a file's, or the fortunes packages' files
    (routing/text.c's choice: every regular file dpkg lists directly under
    /usr/share/games/fortunes except the .dat indexes, sorted by name)."""
    if path:
        with open(path, "rb") as f:
            return f.read()
    files = set()
    for pkg in ("fortunes", "fortunes-min"):
        try:
            out = subprocess.run(["dpkg", "-L", pkg], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        for line in out.splitlines():
            d, base = os.path.split(line)
            if d == FORTUNE_DIR and base and not base.endswith(".dat") and os.path.isfile(line) \
                    and not os.path.islink(line):
                files.add(line)
    if not files:
        raise SystemExit("no corpus: apt-get install fortunes fortunes-min, or pass --data FILE")
    data = bytearray()
    for f in sorted(files, key=os.path.basename):
        with open(f, "rb") as fh:
            data += fh.read()
    return bytes(data)


class LM(torch.nn.Module):
    def __init__(self, swarm):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        self.pos = torch.nn.Embedding(CONTEXT, DIM)
        self.body = starling.RemoteStages(swarm, "tiny-lm", 1)  # (B, 128*256) -> (B, 128, 256)
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        h = self.body(h.contiguous())
        return self.head(self.norm(h))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--initial-peers", help="the swarm's address string(s); default: start a loopback swarm")
    ap.add_argument("--swarm-key", help="swarm key file of a private swarm")
    ap.add_argument("--data", help="corpus file (default: the fortunes packages)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="windows per step (default 8)")
    ap.add_argument("--lr", type=float, default=3e-3, help="the local parts' AdamW learning rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--starling", help="the starling binary for a self-started swarm (default $STARLING)")
    ap.add_argument("--json", action="store_true", help="one JSON line per step")
    a = ap.parse_args(argv)
    torch.manual_seed(a.seed)
    data = torch.frombuffer(bytearray(load_corpus(a.data)), dtype=torch.uint8).long()
    if len(data) < CONTEXT + 2:
        raise SystemExit("the corpus has %d bytes; want at least %d" % (len(data), CONTEXT + 2))
    local = None
    peers = a.initial_peers
    if not peers:
        local = starling.local.LocalSwarm(a.starling)
        peers = local.start_bootstrap()
        local.start_peer("a", "1", model="tiny-lm")
        print("started a loopback swarm: %s (logs in %s)" % (peers, local.dir), file=sys.stderr, flush=True)
    try:
        with starling.Swarm(peers, swarm_key=a.swarm_key, seed=a.seed + 1) as swarm:
            lm = LM(swarm)
            opt = torch.optim.AdamW(lm.parameters(), lr=a.lr)
            g = torch.Generator().manual_seed(a.seed)
            t0 = time.monotonic()
            for step in range(1, a.steps + 1):
                starts = torch.randint(0, len(data) - CONTEXT - 1, (a.batch,), generator=g)
                win = torch.stack([data[s:s + CONTEXT + 1] for s in starts.tolist()])
                logits = lm(win[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), win[:, 1:].reshape(-1))
                opt.zero_grad()
                loss.backward()
                opt.step()
                sv = lm.body.last_served[0]
                if a.json:
                    print(json.dumps({"step": step, "loss": round(loss.item(), 5), "weight_version": sv.weight_version,
                                      "elapsed_s": round(time.monotonic() - t0, 3)}), flush=True)
                else:
                    print("step %d: loss %.4f (%.3f bits/byte), stage 1 at weight version %s on %s"
                          % (step, loss.item(), loss.item() / 0.6931471805599453, sv.weight_version,
                             sv.holder[:8]), flush=True)
    finally:
        if local:
            local.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
