"""Supernet: extraction equivalence, no active-state leak, BN recalibration, checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rafl.errors import UserInputError
from rafl.supernet import (
    ArchConfig,
    SearchSpace,
    build_supernet,
    extract_subnet,
    load_supernet,
    recalibrate_bn,
    save_supernet,
)

SPACE = SearchSpace(width_mult=0.25, resolutions=(16, 20, 24), n_classes=10)


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    model = build_supernet(SPACE)
    # give the BN layers non-trivial running statistics (one train-mode pass per random arch)
    model.train()
    rng = np.random.default_rng(1)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 3, 24, 24) * 2 + 0.5, SPACE.sample(rng))
        model(torch.randn(8, 3, 24, 24), None)
    return model.eval()


def _state(model):
    return ([b.conv.active_kernel_size for b in model.blocks[1:]],
            [b.conv.active_expand_ratio for b in model.blocks[1:]], list(model.runtime_depth))


def test_shapes_and_feature_dim(net):
    x = torch.randn(2, 3, 32, 32)
    assert net(x).shape == (2, 10)
    assert net.features(x, SPACE.smallest()).shape == (2, net.feature_dim)
    assert net.feature_dim == 320  # make_divisible(1280 * 0.25)
    # grayscale images are repeated to 3 channels
    gray = torch.randn(2, 1, 28, 28)
    assert torch.equal(net(gray, SPACE.smallest()), net(gray.expand(-1, 3, -1, -1), SPACE.smallest()))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_extraction_equivalence(net, seed):
    rng = np.random.default_rng(seed)
    archs = [SPACE.sample(rng), SPACE.sample(rng)] + ([SPACE.smallest(), SPACE.largest()] if seed == 0 else [])
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    for arch in archs:
        sub = extract_subnet(net, arch).eval()
        with torch.no_grad():
            ref = net(x, arch)
            out = sub(x)
            feats = sub.features(x)
        assert (ref - out).abs().max().item() <= 1e-5, arch
        assert torch.allclose(sub.head(feats), out)
        assert (net.features(x, arch) - feats).abs().max().item() <= 1e-5
        assert feats.shape == (4, net.feature_dim)
        assert sub.arch == arch


def test_cpu_batches_are_channels_last_and_compute_what_nchw_computes(net):
    """``prepare_input`` lays CPU batches out channels-last (same shape); a subnet's logits and
    gradients are those of the same batch fed NCHW, to float32 rounding; the weights keep NCHW."""
    from rafl.supernet.model import prepare_input

    x = torch.randn(6, 3, 20, 20, generator=torch.Generator().manual_seed(0))
    ready = prepare_input(x, 24)
    assert ready.shape == (6, 3, 24, 24) and ready.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(ready, prepare_input(x, 24).contiguous())
    sub = extract_subnet(net, SPACE.sample(np.random.default_rng(5))).eval()
    with torch.no_grad():
        h = sub.first_conv(prepare_input(x, sub.arch.r).contiguous())  # the NCHW reference, layer by layer
        for block in sub.blocks:
            h = block(h)
        ref = sub.head(sub.feature_mix_layer(sub.final_expand_layer(h).mean((2, 3), keepdim=True)).flatten(1))
        assert (sub(x) - ref).abs().max().item() <= 1e-4
    loss = torch.nn.functional.cross_entropy(sub.train()(x), torch.arange(6) % 10)
    loss.backward()
    assert all(p.is_contiguous() for p in sub.parameters()) and all(torch.isfinite(p.grad).all() for p in sub.parameters())


def test_no_state_leak(net):
    before = _state(net)
    arch = SPACE.smallest()
    with torch.no_grad():
        net(torch.randn(1, 3, 16, 16), arch)
        net.features(torch.randn(1, 3, 16, 16), arch)
        extract_subnet(net, arch)
    assert _state(net) == before
    # also on error inside the forward
    with pytest.raises(UserInputError):
        net(torch.randn(1, 5, 16, 16), arch)
    assert _state(net) == before
    # largest after a small one gives the same as largest before
    x = torch.randn(2, 3, 24, 24)
    with torch.no_grad():
        a = net(x)
        net(x, arch)
        b = net(x)
    assert torch.equal(a, b)


def test_foreign_arch_is_a_clear_error(net):
    other = SearchSpace(d_choices=(2, 3, 4, 5), width_mult=0.25, resolutions=(16, 20, 24))
    with pytest.raises(UserInputError, match="block entries"):
        net(torch.randn(1, 3, 16, 16), other.largest())
    bad = ArchConfig(ks=(9,) * 20, e=(3,) * 20, d=(2,) * 5, r=16)
    with pytest.raises(UserInputError, match=r"ks\[0\].*allowed"):
        extract_subnet(net, bad)


def test_recalibrate_bn_changes_stats_and_restores_accuracy():
    torch.manual_seed(0)
    model = build_supernet(SPACE)
    arch = SPACE.middle()
    sub = extract_subnet(model, arch)
    # data with a large offset: the initial running statistics (0, 1) are badly wrong for it
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(16, 3, 20, 20, generator=gen) * 3 + 5 for _ in range(4)]
    big = torch.cat(xs)
    sub.train()
    with torch.no_grad():
        train_feats = sub.features(big)  # batch statistics (no dropout in features)
    sub.eval()
    bn = sub.first_conv.bn
    mean_before = bn.running_mean.clone()
    with torch.no_grad():
        eval_before = sub.features(big)
    recalibrate_bn(sub, [(x, torch.zeros(16, dtype=torch.long)) for x in xs], n_batches=4)
    assert not sub.training
    assert bn.momentum == 0.1
    assert not torch.allclose(bn.running_mean, mean_before)
    # the recalibrated statistics are the exact average of the per-batch means of the first layer
    with torch.no_grad():
        conv = [sub.first_conv.conv(x).mean((0, 2, 3)) for x in xs]
    assert torch.allclose(bn.running_mean, torch.stack(conv).mean(0), atol=1e-4)
    # one batch holding all the data: eval mode now reproduces the batch-statistics forward
    recalibrate_bn(sub, [big], n_batches=1)
    with torch.no_grad():
        eval_after = sub.features(big)
    err_before = (eval_before - train_feats).abs().mean()
    err_after = (eval_after - train_feats).abs().mean()
    assert err_after < 0.2 * err_before, (err_after, err_before)
    # the supernet form recalibrates a subnet's slices through the supernet
    recalibrate_bn(model, xs, n_batches=2, arch=arch)
    assert not torch.equal(model.first_conv.bn.running_mean, torch.zeros_like(mean_before))
    with pytest.raises(UserInputError, match="n_batches"):
        recalibrate_bn(sub, xs, n_batches=0)


def test_checkpoint_round_trip(net, tmp_path):
    meta = save_supernet(tmp_path / "ck", net, {"seed": 0}, {"acc": 0.5})
    assert meta.name == "supernet.json"
    loaded = load_supernet(tmp_path / "ck", space=SPACE)
    x = torch.randn(3, 3, 24, 24)
    arch = SPACE.sample(np.random.default_rng(5))
    with torch.no_grad():
        assert torch.equal(net(x, arch), loaded(x, arch))
    assert loaded.space == SPACE
    # loads with safetensors alone, and the weights file needs no pickle
    from safetensors.torch import load_file
    assert set(load_file(tmp_path / "ck" / "supernet.safetensors")) == set(net.state_dict())


def test_checkpoint_mismatch_errors(net, tmp_path):
    save_supernet(tmp_path / "ck", net, {}, {})
    with pytest.raises(UserInputError, match="checkpoint has n_classes=10, expected 100"):
        load_supernet(tmp_path / "ck", space=SearchSpace(width_mult=0.25, resolutions=(16, 20, 24), n_classes=100))
    with pytest.raises(UserInputError, match="checkpoint has width_mult=0.25, expected 0.5"):
        load_supernet(tmp_path / "ck", space=SearchSpace(width_mult=0.5, resolutions=(16, 20, 24)))
    # an ofa-style bare state dict with 1000 classes (ImageNet) -> the classic mismatch, named
    state = {k: v.clone() for k, v in net.state_dict().items()}
    state["classifier.linear.weight"] = torch.zeros(1000, net.feature_dim)
    state["classifier.linear.bias"] = torch.zeros(1000)
    torch.save(state, tmp_path / "ofa.pth")
    with pytest.raises(UserInputError, match="checkpoint has n_classes=1000, expected 10"):
        load_supernet(tmp_path / "ofa.pth", space=SPACE)
    with pytest.raises(UserInputError, match="search space"):
        load_supernet(tmp_path / "ofa.pth")
    with pytest.raises(UserInputError, match="no such file"):
        load_supernet(tmp_path / "nothing")


def test_truncated_checkpoint(net, tmp_path):
    save_supernet(tmp_path / "ck", net, {}, {})
    weights = tmp_path / "ck" / "supernet.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserInputError, match="truncated"):
        load_supernet(tmp_path / "ck")
    with pytest.raises(UserInputError, match="truncated"):
        load_supernet(weights, space=SPACE)
    (tmp_path / "ck" / "supernet.json").write_text('{"format": "rafl-sup')
    with pytest.raises(UserInputError, match="not valid JSON"):
        load_supernet(tmp_path / "ck")


def test_recalibrate_bn_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    sub = extract_subnet(build_supernet(SPACE), SPACE.smallest())
    torch.manual_seed(123)
    recalibrate_bn(sub, [torch.randn(4, 3, 16, 16)], n_batches=1)
    after = torch.rand(3)
    torch.manual_seed(123)
    torch.randn(4, 3, 16, 16)
    assert torch.equal(torch.rand(3), after)


def test_narrow_width_keeps_the_most_important_channels(net):
    from rafl.supernet import narrow_width

    sub = extract_subnet(net, SPACE.smallest()).eval()
    x = torch.randn(4, 3, 24, 24, generator=torch.Generator().manual_seed(0))
    full = narrow_width(sub, 1.0)
    with torch.no_grad():
        assert torch.equal(full(x), sub(x))
    half = narrow_width(sub, 0.5).eval()
    fe, fm = sub.final_expand_layer.conv.out_channels, sub.feature_mix_layer.conv.out_channels
    assert half.final_expand_layer.conv.out_channels == round(fe / 2)
    assert half.feature_dim == round(fm / 2) == half.feature_mix_layer.conv.out_channels
    assert half.head.linear.in_features == half.feature_dim
    assert half(x).shape == (4, 10) and half.features(x).shape == (4, half.feature_dim)
    n_params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n_params(half) < n_params(sub)
    # the kept final-expand channels are those with the largest outgoing L1 norm, in order
    imp = sub.feature_mix_layer.conv.weight.abs().sum(dim=(0, 2, 3))
    keep = imp.topk(round(fe / 2)).indices.sort().values
    assert torch.equal(half.final_expand_layer.conv.weight, sub.final_expand_layer.conv.weight[keep])
    assert torch.equal(half.final_expand_layer.bn.running_var, sub.final_expand_layer.bn.running_var[keep])
    # every inverted-residual block keeps half of its hidden channels; its output width is unchanged
    for b_sub, b_half in zip(sub.blocks[1:], half.blocks[1:]):
        mid = b_sub.conv.inverted_bottleneck.conv.out_channels
        assert b_half.conv.inverted_bottleneck.conv.out_channels == round(mid / 2)
        assert b_half.conv.depth_conv.conv.groups == round(mid / 2)
        assert b_half.conv.point_linear.conv.out_channels == b_sub.conv.point_linear.conv.out_channels
    # deterministic: two cuts give identical state dicts (every client builds the same network)
    again = narrow_width(sub, 0.5).state_dict()
    assert all(torch.equal(v, again[k]) for k, v in half.state_dict().items())
    # the source subnet is untouched
    with torch.no_grad():
        assert torch.equal(sub(x), full(x))
    for bad in (0, -0.5, 1.5):
        with pytest.raises(UserInputError, match="knowledge_width.*allowed: a fraction in"):
            narrow_width(sub, bad)
