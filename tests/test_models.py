import pytest
import torch
from torch import nn

torch.set_num_threads(1)

from fedlt.errors import ConfigError  # noqa: E402
from fedlt.models import (  # noqa: E402
    Model,
    backbone_keys,
    bn_keys,
    build_model,
    head_keys,
    module_param_names,
)

SHAPES = [(1, 8, 8), (1, 28, 28), (3, 32, 32)]
SMALL = ["mlp", "smallcnn", "smallcnn-bn", "cnn-mcmahan"]
FEATURE_DIM = {"mlp": 200, "smallcnn": 128, "smallcnn-bn": 128, "cnn-mcmahan": 512, "resnet8": 256, "resnet18": 512,
               "resnet34": 512}


@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("shape", SHAPES)
def test_small_models_shapes(name, shape):
    m = build_model(name, shape, num_classes=10, seed=0)
    assert isinstance(m, Model)
    x = torch.randn(4, *shape)
    assert m.feature_dim == FEATURE_DIM[name] == m.backbone.feature_dim
    assert m.num_classes == 10
    with torch.no_grad():
        f = m.features(x)
        y = m(x)
    assert f.shape == (4, FEATURE_DIM[name])
    assert y.shape == (4, 10)
    assert torch.allclose(m.head(f), y)
    assert isinstance(m.head, nn.Linear) and m.head.bias is not None


@pytest.mark.parametrize("shape", SHAPES)
def test_resnet8_shapes(shape):
    m = build_model("resnet8", shape, num_classes=7, seed=0)
    with torch.no_grad():
        y = m(torch.randn(2, *shape))
        f = m.features(torch.randn(2, *shape))
    assert y.shape == (2, 7) and f.shape == (2, 256)


def test_resnet18_shapes():
    for shape in [(1, 8, 8), (3, 32, 32)]:
        m = build_model("resnet18", shape, num_classes=5, seed=0)
        with torch.no_grad():
            assert m(torch.randn(2, *shape)).shape == (2, 5)
        assert m.feature_dim == 512


def test_resnet34_single_forward():
    m = build_model("resnet34", (3, 32, 32), num_classes=100, seed=0).eval()
    with torch.no_grad():
        assert m(torch.randn(2, 3, 32, 32)).shape == (2, 100)
    assert m.feature_dim == 512


def test_mcmahan_param_count():
    # McMahan et al. (2017): the MNIST CNN has 1,663,370 parameters.
    m = build_model("cnn-mcmahan", (1, 28, 28), num_classes=10, seed=0)
    assert sum(p.numel() for p in m.parameters()) == 1_663_370


@pytest.mark.parametrize("name", ["smallcnn", "resnet8"])
def test_seed_determinism(name):
    a = build_model(name, (3, 32, 32), 10, seed=123).state_dict()
    b = build_model(name, (3, 32, 32), 10, seed=123).state_dict()
    c = build_model(name, (3, 32, 32), 10, seed=124).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())
    # the head too, not only the backbone
    assert not torch.equal(a["head.weight"], c["head.weight"])


def test_global_rng_untouched():
    torch.manual_seed(7)
    state = torch.get_rng_state()
    build_model("smallcnn", (1, 28, 28), 10, seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    expected = torch.rand(3)
    torch.manual_seed(7)
    build_model("mlp", (1, 8, 8), 10, seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_bn_keys_by_type():
    m = build_model("resnet8", (3, 32, 32), 10, seed=0)
    keys = bn_keys(m)
    assert keys == module_param_names(m, nn.BatchNorm2d)
    assert keys == module_param_names(m, (nn.BatchNorm1d, nn.BatchNorm2d))
    sd = m.state_dict()
    assert keys <= set(sd)
    suffixes = {k.rsplit(".", 1)[1] for k in keys}
    assert suffixes == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
    n_bn = sum(isinstance(mod, nn.BatchNorm2d) for mod in m.modules())
    assert len(keys) == 5 * n_bn
    # no conv or head weight sneaks in
    assert not any(k.startswith("head.") for k in keys)
    conv_w = {f"{n}.weight" for n, mod in m.named_modules() if isinstance(mod, nn.Conv2d)}
    assert not (keys & conv_w)
    # a model without BN has none
    assert bn_keys(build_model("smallcnn", (1, 8, 8), 10, seed=0)) == set()


def test_smallcnn_bn_is_smallcnn_plus_batchnorm():
    plain = build_model("smallcnn", (1, 28, 28), 10, seed=0)
    bn = build_model("smallcnn-bn", (1, 28, 28), 10, seed=0)
    kinds = [type(mod) for mod in bn.modules() if isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d))]
    assert kinds == [nn.BatchNorm2d, nn.BatchNorm2d, nn.BatchNorm1d]
    shapes = lambda m, keys: sorted(tuple(v.shape) for k, v in m.state_dict().items() if k in keys)  # noqa: E731
    assert shapes(bn, set(bn.state_dict()) - bn_keys(bn)) == shapes(plain, set(plain.state_dict()))
    # the feature BN sits between the linear layer and the ReLU: in train mode its output has per-unit batch
    # mean 0 and variance 1 (weight 1, bias 0 at init), whatever the input scale
    bn.train()
    pre = bn.backbone.fc[1](bn.backbone.fc[0](bn.backbone.conv(5 * torch.randn(256, 1, 28, 28) + 3)))
    assert pre.mean(0).abs().max() < 1e-4 and (pre.var(0, unbiased=False) - 1).abs().max() < 1e-2


def test_head_and_backbone_keys():
    m = build_model("smallcnn", (1, 28, 28), 10, seed=0)
    hk = head_keys(m)
    assert hk == {"head.weight", "head.bias"}
    assert hk == {f"head.{k}" for k in m.head.state_dict()}
    bk = backbone_keys(m)
    assert bk | hk == set(m.state_dict()) and not (bk & hk)
    assert module_param_names(m, nn.Linear) >= hk


def test_unknown_model():
    with pytest.raises(ConfigError, match="unknown model"):
        build_model("resnet9000", (3, 32, 32), 10, seed=0)


# ---------------------------------------------------------------------------------------------- the seeds' models
def _count(name_or_backbone, in_shape, num_classes):
    """Parameters of backbone + linear head, built on the meta device (no memory, no initialisation cost)."""
    with torch.device("meta"):
        if isinstance(name_or_backbone, str):
            return sum(p.numel() for p in build_model(name_or_backbone, in_shape, num_classes).parameters())
        b = name_or_backbone(in_shape)
        return sum(p.numel() for p in b.parameters()) + b.feature_dim * num_classes + num_classes


@pytest.mark.parametrize("name,shape,classes,expected", [
    ("resnet50", (3, 224, 224), 1000, 25_557_032),          # torchvision resnet50 (He et al. 2016)
    ("mobilenet", (3, 224, 224), 1000, 4_231_976),          # MobileNet v1 1.0 (Howard et al. 2017: 4.2 M)
    ("mobilenet", (3, 32, 32), 100, 4_231_976 - 1024 * 900 - 900),  # FedDr+'s CIFAR-100 MobileNetCifar
    ("vgg11", (3, 32, 32), 10, 9_750_922),                  # FedDr+'s CIFAR-10 vgg11 (fc 512-512)
])
def test_parameter_counts_match_the_reference_architectures(name, shape, classes, expected):
    assert _count(name, shape, classes) == expected


def test_vgg11_convolutions_match_torchvision_vgg11():
    from fedlt.models import VGG

    # torchvision's vgg11 = our convolutional stack + 4096-unit classifier with dropout on 224x224 inputs
    assert _count(lambda s: VGG(s, fc_dim=4096, dropout=True), (3, 224, 224), 1000) == 132_863_336


def test_resnet50_stems_and_mobilenet_batch_statistics():
    r = build_model("resnet50", (3, 64, 64), 10, seed=0)
    rc = build_model("resnet50-cifar", (3, 32, 32), 10, seed=0)
    assert r.feature_dim == rc.feature_dim == 2048
    assert r.backbone.stem[0].kernel_size == (7, 7) and isinstance(r.backbone.stem[-1], nn.MaxPool2d)
    assert rc.backbone.stem[0].kernel_size == (3, 3) and len(rc.backbone.stem) == 3
    with torch.no_grad():
        assert r.eval()(torch.randn(2, 3, 64, 64)).shape == (2, 10)
    # FedDr+'s MobileNet keeps no running statistics: BN weights and biases only, and batch statistics in eval
    mb = build_model("mobilenet-batchstats", (3, 32, 32), 100, seed=0).eval()
    ms = build_model("mobilenet", (3, 32, 32), 100, seed=0).eval()
    assert not any(k.endswith("running_mean") for k in bn_keys(mb))
    assert any(k.endswith("running_mean") for k in bn_keys(ms))
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        f = mb.features(x)
        assert not torch.allclose(mb.features(x[:2]), f[:2], atol=1e-4)  # depends on the batch: batch statistics
        assert torch.allclose(ms.features(x[:2]), ms.features(x)[:2], atol=1e-5)
    v = build_model("vgg11", (1, 28, 28), 10, seed=0)
    assert v.backbone.fc[0].in_features == 512  # FedDr+ drops the last max-pool on 28x28


def test_resnet56_is_fifty_six_weighted_layers_of_fedml_shape():
    """RedGrape's CIFAR model (FedML's resnet56): stem + 3 stages x 6 Bottlenecks x 3 convolutions + the head
    = 56 weighted layers (1x1 shortcut projections not counted, as in He et al.), widths 16/32/64 x 4."""
    m = build_model("resnet56", (3, 32, 32), num_classes=10, seed=0)
    shortcut = {id(c) for mod in m.backbone.modules() if hasattr(mod, "shortcut") for c in mod.shortcut.modules()}
    convs = [c for c in m.backbone.modules() if isinstance(c, nn.Conv2d) and id(c) not in shortcut]
    assert len(convs) + 1 == 56 and m.feature_dim == 256
    assert [len(s) for s in m.backbone.stages] == [6, 6, 6] and m.backbone.stem[0].out_channels == 16
    with torch.no_grad():
        assert m.eval()(torch.randn(2, 3, 32, 32)).shape == (2, 10)
