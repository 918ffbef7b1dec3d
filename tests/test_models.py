"""Heterogeneous model groups and user plug-in models."""

from __future__ import annotations

import pytest
import torch

from rafl.errors import UserInputError
from rafl.models import GROUPS, HeteroModel, build_model, build_plugin_model, make_member, resolve_models

CHEAP = ["cnn4", "cnn4-small", "cnn3-small", "mobilenet_v2-0.25", "shufflenet_v2-0.5", "resnet18"]


@pytest.mark.parametrize("name", CHEAP)
def test_members_give_common_width_at_32px_rgb_and_gray(name):
    torch.manual_seed(0)
    m = build_model(name, n_classes=7, feature_dim=24)
    assert isinstance(m, HeteroModel) and m.feature_dim == 24
    m.eval()
    with torch.no_grad():
        for c in (3, 1):
            x = torch.randn(3, c, 32, 32)
            f = m.features(x)
            assert f.shape == (3, 24) and torch.isfinite(f).all()
            assert m(x).shape == (3, 7)
    assert isinstance(m.head, torch.nn.Linear) and m.head.in_features == 24


def test_heads_of_a_group_share_one_shape():
    shapes = {tuple(v.shape) for n in GROUPS["htfe-tiny"] for v in build_model(n, 10, 32).head.state_dict().values()}
    assert shapes == {(10, 32), (10,)}


def test_resolve_models():
    assert resolve_models("htfe4") == list(GROUPS["htfe4"])
    assert len(resolve_models("htfe8")) == 8
    assert resolve_models("cnn4, htfe-tiny") == ["cnn4", *GROUPS["htfe-tiny"]]
    assert resolve_models("nas") == ["nas"]
    assert resolve_models("mypkg.models:factory,cnn4") == ["mypkg.models:factory", "cnn4"]
    for bad in ("", "nas,cnn4", "resnet9000", "htfe5", "cnn4,", "pkg.mod:", ":factory"):
        with pytest.raises(UserInputError, match="clients.models"):
            resolve_models(bad)
    # exact names, but the nearest one is named
    for typo, meant in (("CNN4", "cnn4"), ("ResNet18", "resnet18"), ("mobilenet-v2", "mobilenet_v2")):
        with pytest.raises(UserInputError, match=f"unknown model '{typo}'; did you mean '{meant}'\\?"):
            resolve_models(typo)
    with pytest.raises(UserInputError, match="item 2 of 'cnn4,,cnn3-small' is empty"):
        resolve_models("cnn4,,cnn3-small")
    with pytest.raises(UserInputError, match="item 1 of ',' is empty"):
        resolve_models(",")


def _write_plugin(tmp_path, monkeypatch, body: str) -> None:
    (tmp_path / "my_plugin.py").write_text("import torch\nfrom torch import nn\n" + body)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_user_plugin_model_joins(tmp_path, monkeypatch):
    _write_plugin(tmp_path, monkeypatch,
                  "class Net(nn.Module):\n"
                  "    def __init__(self, n_classes, feature_dim):\n"
                  "        super().__init__()\n"
                  "        self.f = nn.Sequential(nn.Flatten(), nn.LazyLinear(feature_dim))\n"
                  "        self.head = nn.Linear(feature_dim, n_classes)\n"
                  "    def features(self, x):\n"
                  "        return self.f(x)\n"
                  "    def forward(self, x):\n"
                  "        return self.head(self.features(x))\n"
                  "def factory(n_classes, feature_dim):\n"
                  "    return Net(n_classes, feature_dim)\n"
                  "def bad_width():\n"
                  "    return Net(10, 5)\n"
                  "def not_a_model():\n"
                  "    return 3\n"
                  "def no_head():\n"
                  "    return nn.Linear(3, 3)\n"
                  "def boom():\n"
                  "    raise RuntimeError('nope')\n"
                  "class NoFwd(nn.Module):\n"
                  "    def __init__(self):\n"
                  "        super().__init__()\n"
                  "        self.f = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 16), nn.BatchNorm1d(16))\n"
                  "        self.head = nn.Linear(16, 10)\n"
                  "    def features(self, x):\n"
                  "        return self.f(x)\n"
                  "def no_forward():\n"
                  "    return NoFwd()\n"
                  "class WrongFwd(Net):\n"
                  "    def forward(self, x):\n"
                  "        return self.features(x)\n"
                  "def wrong_forward():\n"
                  "    return WrongFwd(10, 16)\n"
                  "class TupleHead(Net):\n"
                  "    def __init__(self):\n"
                  "        super().__init__(10, 16)\n"
                  "        self.head = TwoOut()\n"
                  "class TwoOut(nn.Module):\n"
                  "    def forward(self, z):\n"
                  "        return z, z\n"
                  "def tuple_head():\n"
                  "    return TupleHead()\n"
                  "class ConvMap(Net):\n"
                  "    def features(self, x):\n"
                  "        return torch.zeros(x.shape[0], 16, 32, 32)\n"
                  "def conv_map():\n"
                  "    return ConvMap(10, 16)\n"
                  "def kwargs_only(**kw):\n"
                  "    return Net(kw['n_classes'], kw['feature_dim'])\n"
                  "class AuxOut(Net):\n"  # torchvision GoogLeNet-style: a tuple only while training
                  "    def forward(self, x):\n"
                  "        z = self.head(self.features(x))\n"
                  "        return (z, z) if self.training else z\n"
                  "def aux_out():\n"
                  "    return AuxOut(10, 16)\n"
                  "def exits():\n"
                  "    import sys\n"
                  "    sys.exit(0)\n")
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(0)\n")
    (tmp_path / "broken_at_import.py").write_text("raise RuntimeError('config server down')\n")
    (tmp_path / "bad_syntax.py").write_text("def f(:\n")
    m = make_member("my_plugin:factory", 10, 16)
    assert m(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    # a **kwargs factory gets both keywords
    assert build_plugin_model("my_plugin:kwargs_only", 10, 16).head.out_features == 10
    cases = {"my_plugin:bad_width": "features\\(\\) gives shape \\[2, 5\\], expected a tensor of shape \\[2, 16\\]",
             "my_plugin:conv_map": "features\\(\\) gives shape \\[2, 16, 32, 32\\], expected a tensor of shape "
                                   "\\[2, 16\\] \\(the group's common width D\\)", "my_plugin:not_a_model": "nn.Module",
             "my_plugin:no_head": "features", "my_plugin:boom": "RuntimeError",
             "my_plugin:missing": "no callable", "my_plugin:wrong_forward": "forward gives shape \\[2, 16\\]",
             "no_such_module_xyz:f": "cannot import",
             "bad spec": "not package", "my_plugin:tuple_head": "head gives tuple, expected a tensor of shape \\[2, 10\\] \\(logits\\)",
             "broken_at_import:f": "importing 'broken_at_import' raised RuntimeError: config server down",
             "bad_syntax:f": "importing 'bad_syntax' raised SyntaxError",
             # found only in train mode (crashed local training with a traceback)
             "my_plugin:aux_out": "forward in train mode gives tuple, expected a tensor of shape \\[2, 10\\]",
             # sys.exit in the user's code ended rafl with status 0 and no output
             "my_plugin:exits": "my_plugin:exits raised SystemExit", "exits_at_import:f": "raised SystemExit"}
    for spec, msg in cases.items():
        with pytest.raises(UserInputError, match=msg) as err:
            build_plugin_model(spec, 10, 16)
        assert err.value.field == "clients.models", (spec, err.value.field)  # rafl compare names --models
    # the README's contract needs only features + head: forward = head(features(x)), also on copies
    import copy

    nf = build_plugin_model("my_plugin:no_forward", 10, 16)
    x = torch.randn(4, 3, 32, 32)
    nf.eval()
    assert torch.equal(nf(x), nf.head(nf.features(x)))
    twin = copy.deepcopy(nf)
    torch.nn.init.zeros_(twin.head.weight), torch.nn.init.zeros_(twin.head.bias)
    assert torch.equal(twin(x), torch.zeros(4, 10)) and not torch.equal(nf(x), torch.zeros(4, 10))


def test_small_image_variants_keep_spatial_resolution():
    from rafl.models.zoo import BACKBONES

    torch.manual_seed(0)
    for name, size in (("resnet18", 4), ("shufflenet_v2-0.5", 2), ("mobilenet_v2-0.25", 2)):
        backbone, _ = BACKBONES[name]()
        backbone.eval()
        seen = []
        last_bn = [m for m in backbone.modules() if isinstance(m, torch.nn.BatchNorm2d)][-1]
        last_bn.register_forward_hook(lambda m, i, o: seen.append(o.shape[-1]))
        with torch.no_grad():
            backbone(torch.randn(2, 3, 32, 32))
        assert seen[-1] == size, name


def test_plugin_module_in_the_current_folder_is_found(tmp_path, monkeypatch):
    """The `rafl` console script does not put the current folder on sys.path (`python -m` does);
    plug-ins are looked up there too, after everything installed."""
    import sys

    (tmp_path / "cwd_plugin_xyz.py").write_text(
        "from torch import nn\n"
        "class N(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.f = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 16))\n"
        "        self.head = nn.Linear(16, 10)\n"
        "    def features(self, x):\n"
        "        return self.f(x)\n"
        "def make():\n"
        "    return N()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert build_plugin_model("cwd_plugin_xyz:make", 10, 16)(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
