"""Pre-trained backbones (fedlt.pretrained): tiny random transformers models saved with save_pretrained and loaded
by --model hf:<dir>, features equal to the model's own pooled output; pickle-only directories and hub ids missing
offline refused in one line; EfficientNet-Lite0 giving the package's own logits, its 1x1 swap changing nothing;
the CLIP text head's rows; FedGPA's ViT and CLIP2FL's tower read through the same path. No network: every test
runs with HF_HUB_OFFLINE=1."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may reach the network (set before transformers is imported)
transformers = pytest.importorskip("transformers")

from fedlt import pretrained  # noqa: E402
from fedlt.data.transforms import to_model_input  # noqa: E402
from fedlt.errors import ConfigError  # noqa: E402
from fedlt.models import FixedLinear, build_model  # noqa: E402

OFFLINE = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def fedlt(*args, env=None):
    e = {**os.environ, **OFFLINE, **(env or {})}
    return subprocess.run([sys.executable, "-m", "fedlt", *args], capture_output=True, text=True, env=e, timeout=300)


def quiet_save(model, d):
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                 image_size=32, patch_size=8)
    m = transformers.ViTModel(cfg).eval()
    return quiet_save(m, tmp_path_factory.mktemp("vit")), m


@pytest.fixture(scope="module")
def resnet_dir(tmp_path_factory):
    torch.manual_seed(1)
    cfg = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="bottleneck",
                                    image_size=32)
    m = transformers.ResNetModel(cfg).eval()
    return quiet_save(m, tmp_path_factory.mktemp("resnet")), m


@pytest.fixture(scope="module")
def convnext_dir(tmp_path_factory):
    torch.manual_seed(2)
    cfg = transformers.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=32)
    m = transformers.ConvNextModel(cfg).eval()
    d = quiet_save(m, tmp_path_factory.mktemp("convnext"))
    (d / "preprocessor_config.json").write_text(json.dumps({  # the model's own preprocessing, read from here
        "do_normalize": True, "image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.25, 0.3], "resample": 2,
        "size": {"height": 40, "width": 40}}))
    return d, m


def tiny_tokenizer(d):
    """A character-level CLIP BPE vocabulary (no merges): enough to tokenize prompts, written by hand."""
    vocab = {}
    for c in "abcdefghijklmnopqrstuvwxyz0123456789-/":
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = len(vocab), len(vocab) + 1
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "merges.txt").write_text("#version: 0.2\n")
    tok = transformers.CLIPTokenizer(str(d / "vocab.json"), str(d / "merges.txt"))
    tok.save_pretrained(str(d))
    return tok, vocab


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    torch.manual_seed(3)
    d = tmp_path_factory.mktemp("clip")
    tok, vocab = tiny_tokenizer(d)
    eot = vocab["<|endoftext|>"]
    cfg = transformers.CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=eot - 1,
                         eos_token_id=eot, pad_token_id=eot),
        vision_config=dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8), projection_dim=16)
    m = transformers.CLIPModel(cfg).eval()
    return quiet_save(m, d), m, tok


def _tensor(out):
    """get_*_features' result: a tensor, or (transformers 5) an output whose pooler_output is the projection."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


# ------------------------------------------------------------------------------------------------ hf: models


def test_hf_vit_features_are_the_models_pooled_output(vit_dir):
    d, m = vit_dir
    pre = pretrained.load(f"hf:{d}")
    assert pre is pretrained.load(f"hf:{d}")  # one shared object per process
    assert pre.family == "vit" and not pre.has_batchnorm and pre.feature_dim == 32
    assert pre.preprocess.size == (32, 32) and pre.preprocess.channels == 3
    assert pre.lora_targets and all(t.rsplit(".", 1)[-1] in ("q_proj", "v_proj", "query", "value")
                                    for t in pre.lora_targets)
    assert not any(p.requires_grad for p in pre.net.parameters()) and not pre.net.training
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(pre.net(x), m(pixel_values=x).pooler_output)


@pytest.mark.parametrize("which", ["resnet_dir", "convnext_dir"])
def test_hf_convnets_pooled_output_and_their_own_preprocessing(which, request):
    d, m = request.getfixturevalue(which)
    pre = pretrained.load(f"hf:{d}")
    assert pre.family == "convnet"
    assert pre.has_batchnorm == (which == "resnet_dir")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(pre.net(x), m(pixel_values=x).pooler_output.flatten(1))
    if which == "convnext_dir":  # preprocessor_config.json's size, statistics and resampling, not ImageNet's
        assert pre.preprocess.size == (40, 40) and pre.preprocess.mean == (0.5, 0.4, 0.3)
        assert pre.preprocess.resample == "bilinear"
        assert all(m_.kernel_size == (1, 1) for n, m_ in pre.net.named_modules() if n in pre.lora_targets
                   and isinstance(m_, torch.nn.Conv2d))
    else:  # its bottleneck blocks' 1x1 convolutions are LoRA's default targets
        convs = {n for n, m_ in pre.net.named_modules() if isinstance(m_, torch.nn.Conv2d)
                 and m_.kernel_size == (1, 1) and m_.groups == 1}
        assert set(pre.lora_targets) == convs and convs


def test_backbone_feeds_the_model_its_own_input(vit_dir):
    """A fedlt batch (grey, 8x8, normalised with the dataset's statistics) -> the model's 3x32x32 input."""
    d, m = vit_dir
    mean, std = (0.3,), (0.4,)
    model = build_model(f"hf:{d}", (1, 8, 8), 5, seed=0, input_norm=(mean, std))
    img = torch.rand(2, 1, 8, 8)  # [0, 1] images
    x = (img - 0.3) / 0.4
    want = torch.nn.functional.interpolate(img.expand(-1, 3, -1, -1), size=(32, 32), mode="bicubic",
                                           align_corners=False).clamp(-10, 10)
    inet = torch.tensor(pretrained.IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(pretrained.IMAGENET_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(model.backbone.prepare(x), (want - inet[0]) / inet[1], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model.features(x), m(pixel_values=model.backbone.prepare(x)).pooler_output)
    # trainable (full fine-tuning): the backbone's weights are the model's own, a copy of the shared frozen net
    assert any(k.startswith("backbone.net.") for k in model.state_dict())
    assert all(p.requires_grad for p in model.parameters())
    shared = pretrained.load(f"hf:{d}").net
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(model.backbone.net.parameters(), shared.parameters()))
    frozen = pretrained.load(f"hf:{d}").backbone(((0.3,), (0.4,)), trainable=False)
    assert frozen.net is shared and not frozen.state_dict()  # outside the module tree


def test_run_through_the_cli_says_how_it_feeds_the_model(vit_dir, tmp_path):
    d, _ = vit_dir
    r = fedlt("run", "--model", f"hf:{d}", "--preset", "smoke", "--rounds", "2", "--eval-every", "2", "--threads",
              "1", "--no-progress", "--out", str(tmp_path), "--name", "v")
    assert r.returncode == 0, r.stderr
    assert f"model hf:{d}: 1x8x8 images resized (bicubic) to 3x32x32, grey repeated to 3 channels" in r.stdout
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    assert cfg["model"] == f"hf:{d}"
    assert (tmp_path / "v" / "summary.json").is_file()


def test_a_pickle_only_directory_is_refused_in_one_line(vit_dir, tmp_path):
    d, m = vit_dir
    pkl = tmp_path / "pickled"
    pkl.mkdir()
    (pkl / "config.json").write_text((d / "config.json").read_text())
    torch.save(m.state_dict(), pkl / "pytorch_model.bin")
    out = tmp_path / "runs"
    r = fedlt("run", "--model", f"hf:{pkl}", "--preset", "smoke", "--rounds", "1", "--out", str(out))
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "pytorch_model.bin" in err and "safetensors" in err
    assert not out.exists()


def test_a_hub_id_missing_offline_is_one_line_naming_model_cache_and_offline(tmp_path):
    cache = tmp_path / "hub-cache"
    out = tmp_path / "runs"
    r = fedlt("run", "--model", "hf:fedlt-tests/no-such-model", "--preset", "smoke", "--rounds", "1", "--out",
              str(out), env={"HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "hf-home")})
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "hf:fedlt-tests/no-such-model" in err and str(cache) in err and "HF_HUB_OFFLINE" in err
    assert not out.exists()


def test_pretrained_size_applies_only_to_pretrained_models(vit_dir, tmp_path):
    d, _ = vit_dir
    pre = pretrained.load(f"hf:{d}", size=16)  # a ViT fed 16x16: its position embeddings interpolated
    assert pre.preprocess.size == (16, 16)
    assert pre.net(torch.randn(1, 3, 16, 16)).shape == (1, 32)
    r = fedlt("run", "--pretrained-size", "64", "--preset", "smoke", "--out", str(tmp_path / "runs"))
    assert r.returncode == 2 and "--pretrained-size applies to pre-trained models" in r.stderr


# ------------------------------------------------------------------------------------------------ EfficientNet-Lite0


@pytest.fixture(scope="module")
def lite0():
    pytest.importorskip("efficientnet_lite_pytorch")
    return pretrained.load(pretrained.EFFICIENTNET_LITE0)


def an_image(size: int) -> torch.Tensor:
    """A smooth colour image (gradients and a disc), ImageNet-normalised, [1, 3, size, size]."""
    t = torch.linspace(0, 1, size)
    yy, xx = torch.meshgrid(t, t, indexing="ij")
    disc = (((xx - 0.6) ** 2 + (yy - 0.4) ** 2) < 0.08).float()
    img = torch.stack([xx, yy * (1 - disc) + disc, 0.5 * (1 - xx) + 0.5 * disc])[None]
    return to_model_input(img, (0.0,), (1.0,), size, pretrained.IMAGENET_MEAN, pretrained.IMAGENET_STD)


@pytest.mark.parametrize("size", [224, 64])
def test_efficientnet_lite0_gives_the_packages_own_logits(lite0, size):
    from efficientnet_lite_pytorch import EfficientNet

    sd = pretrained.efficientnet_lite0_state()
    ref = EfficientNet.from_name("efficientnet-lite0", image_size=size)  # the package's static padding
    ref.load_state_dict(sd)
    x = an_image(size)
    with torch.no_grad():
        want = ref.eval()(x)
        got = lite0.net(x) @ sd["_fc.weight"].T + sd["_fc.bias"]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert want.abs().max() > 1  # real logits, not a degenerate map


def test_efficientnet_lite0_pointwise_swap_changes_nothing(lite0):
    from efficientnet_lite_pytorch import EfficientNet

    body = EfficientNet.from_name("efficientnet-lite0", image_size=None)
    body.load_state_dict(pretrained.efficientnet_lite0_state())
    body.eval()
    x = an_image(96)
    with torch.no_grad():
        before = body.extract_features(x)
        assert pretrained.swap_pointwise(body) == 32
        after = body.extract_features(x)
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    pointwise = [m for m in body.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (1, 1)]
    assert len(pointwise) == 32 and all(type(m) is torch.nn.Conv2d for m in pointwise)
    bns = [m for m in lite0.net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert lite0.has_batchnorm and len(bns) == 49
    assert all(m.momentum == pretrained.LITE0_BN_MOMENTUM for m in bns)  # running statistics that follow fine-tuning
    assert len(lite0.lora_targets) == 32 and lite0.family == "convnet" and lite0.feature_dim == 1280


# ------------------------------------------------------------------------------------------------ CLIP


def test_clip_text_head_rows_are_the_normalised_prompt_embeddings(clip_dir):
    d, m, tok = clip_dir
    names = ["T-shirt/top", "ankle boot", "sweet_pepper"]
    with torch.no_grad():
        t = _tensor(m.get_text_features(**tok(["a photo of a T-shirt/top", "a photo of a ankle boot",
                                                "a photo of a sweet pepper"], padding=True, return_tensors="pt")))
    want = torch.nn.functional.normalize(t, dim=1)
    torch.testing.assert_close(pretrained.clip_text_head(f"hf:{d}", names), want)
    # the model: CLIP's image embeddings as features, the head's rows the text embeddings, bias 0
    model = build_model(f"hf:{d}", (3, 32, 32), 3, seed=0, head="clip-text", class_names=names)
    torch.testing.assert_close(model.head.weight, want)
    assert not model.head.bias.any() and model.head.weight.requires_grad
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        img = _tensor(m.get_image_features(pixel_values=model.backbone.prepare(x)))
        torch.testing.assert_close(model.features(x), img)
        # zero-shot CLIP's prediction: argmax of cos(image, text)
        assert torch.equal(model(x).argmax(1), (torch.nn.functional.normalize(img, dim=1) @ want.T).argmax(1))
    fixed = build_model(f"hf:{d}", (3, 32, 32), 3, seed=0, head="clip-text", head_fixed=True, class_names=names)
    assert isinstance(fixed.head, FixedLinear) and not list(fixed.head.parameters())
    assert {"head.weight", "head.bias"} <= set(fixed.state_dict())


def test_zero_shot_clip_run_keeps_the_text_head(clip_dir, tmp_path):
    """--head clip-text --head-fixed --finetune head --local-epochs 0: nothing trains, the run's head is the text
    embeddings of the dataset's class names; without --local-epochs 0 it is refused (nothing would train)."""
    from safetensors.torch import load_file

    d, _, _ = clip_dir
    args = ["run", "--model", f"hf:{d}", "--head", "clip-text", "--head-fixed", "--finetune", "head", "--preset",
            "smoke", "--rounds", "1", "--threads", "1", "--no-progress"]
    r = fedlt(*args, "--out", str(tmp_path / "no"))
    assert r.returncode == 2 and "--local-epochs 0" in r.stderr and not (tmp_path / "no").exists()
    r = fedlt(*args, "--local-epochs", "0", "--out", str(tmp_path), "--name", "z")
    assert r.returncode == 0, r.stderr
    from fedlt.data.datasets import DIGIT_CLASSES

    head = {k: v for k, v in load_file(str(tmp_path / "z" / "final_state.safetensors")).items()
            if k.endswith("head.weight")}
    assert head and all(torch.allclose(w, pretrained.clip_text_head(f"hf:{d}", DIGIT_CLASSES)) for w in head.values())


def test_clip_text_head_refusals(vit_dir, clip_dir, tmp_path):
    d, _ = vit_dir
    with pytest.raises(ConfigError, match="needs a CLIP model"):
        pretrained.clip_text_head(f"hf:{d}", ["a", "b"])
    with pytest.raises(ConfigError, match="class names"):
        pretrained.clip_text_head(f"hf:{clip_dir[0]}", [])
    r = fedlt("run", "--head", "clip-text", "--preset", "smoke", "--out", str(tmp_path / "runs"))
    assert r.returncode == 2 and "--head clip-text needs a CLIP model" in r.stderr


def test_fedgpa_vit_and_clip2fl_tower_load_through_hf(vit_dir, clip_dir):
    from fedlt.core.clip import load_image_tower, load_text_embeddings
    from fedlt.core.vit import load_vit

    d, m = vit_dir
    tower = load_vit(f"hf:{d}")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(tower(x), m(pixel_values=x).last_hidden_state[:, 0], atol=1e-5, rtol=1e-5)
    cd, cm, tok = clip_dir
    image = load_image_tower(f"hf:{cd}")
    with torch.no_grad():
        torch.testing.assert_close(image(x), _tensor(cm.get_image_features(pixel_values=x)), atol=1e-5, rtol=1e-5)
    text = load_text_embeddings(f"hf:{cd}", 2, class_names=["cat", "dog"])
    torch.testing.assert_close(text, pretrained.clip_text_head(f"hf:{cd}", ["cat", "dog"]))


def test_datasets_name_their_classes():
    from fedlt.data import load_dataset
    from fedlt.data.datasets import CIFAR10_CLASSES, CIFAR100_CLASSES, FASHION_MNIST_CLASSES

    assert load_dataset("digits").class_names == ["zero", "one", "two", "three", "four", "five", "six", "seven",
                                                  "eight", "nine"]
    assert len(set(FASHION_MNIST_CLASSES)) == 10 and len(set(CIFAR10_CLASSES)) == 10
    assert len(set(CIFAR100_CLASSES)) == 100 and CIFAR100_CLASSES == tuple(sorted(CIFAR100_CLASSES))
