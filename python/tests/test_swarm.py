"""Swarm: models, holders, raw records, model facts, initial weights."""
import torch

import starling


def test_models_and_holders(pair_swarm, swarm_of):
    s = swarm_of(pair_swarm)
    assert len(s.node_id) == 40 and int(s.node_id, 16) >= 0
    models = s.models()
    names = [m.name for m in models]
    assert "fmnist-mlp" in names, models
    m = models[names.index("fmnist-mlp")]
    assert isinstance(m, starling.ModelInfo) and m.stages == 6 and m.announcers >= 2
    for stage in range(1, 5):
        hs = s.holders("fmnist-mlp", stage)
        ids = {h.id for h in hs}
        assert set(pair_swarm.ids.values()) <= ids, (stage, hs)
        for h in hs:
            assert isinstance(h, starling.Holder)
            if h.id in pair_swarm.ids.values():
                assert h.state == "online" and h.usable and h.addr.startswith("127.0.0.1:")
                assert h.device == "cpu" and not h.frozen and h.weight_version >= 0
    assert s.holders("fmnist-mlp", 0) == []


def test_put_and_get(pair_swarm, swarm_of):
    s = swarm_of(pair_swarm)
    n = s.put("python-test.record", b"hello \x00 world", ttl=30)
    assert n >= 1
    recs = s.get("python-test.record")
    mine = [r for r in recs if r.subkey == bytes.fromhex(s.node_id)]
    assert mine and mine[0].value == b"hello \x00 world" and mine[0].signed, recs
    assert 0 < mine[0].expires_in_s <= 30
    assert s.get("python-test.nothing-here") == []


def test_model_info_and_init_params(pair_swarm, swarm_of):
    s = swarm_of(pair_swarm)
    info = s.model_info("fmnist-mlp")
    assert [st["kind"] for st in info["stages"]][1:5] == ["resffn"] * 4
    st = info["stages"][2]
    assert st["in_shape"] == [512] and st["out_shape"] == [512]
    p = s.init_params("fmnist-mlp", 2)
    assert set(p) == {"ln_w", "ln_b", "fc1_w", "fc1_b", "fc2_w", "fc2_b"}
    assert sum(t.numel() for t in p.values()) == st["params"]
    assert p["fc1_w"].shape == (2048, 512) and p["fc2_w"].shape == (512, 2048)
    assert torch.all(p["ln_w"] == 1) and torch.all(p["ln_b"] == 0)
    # The same without a swarm (a built-in model), and the same numbers.
    q = starling.init_params("fmnist-mlp", 2)
    assert all(torch.equal(p[k], q[k]) for k in p)
    # A decoder stage of two layers: repeated names are keyed by layer.
    lm = starling.init_params("tiny-lm", 1)
    assert any(k.startswith("0.") for k in lm) and any(k.startswith("1.") for k in lm), sorted(lm)
