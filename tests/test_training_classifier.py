"""Fine-tuning a converted classifier (`cbcert.training.classifier`): one step equals
PyTorch's SGD step on the same weights and batch; a new head is drawn as torch.nn.Linear."""

import numpy as np
import pytest
import torch
from parity import assert_parity, float64_copy
from test_convert_resnet import (
    TorchBasicBlock,
    TorchResNet,
    randomize,
    state_dict_numpy,
    torch_resnet,
)

from cbcert.convert import torchvision
from cbcert.convert.common import fill_module
from cbcert.models.resnet import ResNetConfig
from cbcert.schema import ConfigError
from cbcert.training.classifier import (
    ClassifierTrainConfig,
    init_state,
    make_step,
    set_classes,
    trained_module,
)

MEAN = np.array([0.485, 0.456, 0.406])
STD = np.array([0.229, 0.224, 0.225])


def _torch_step(net, x, y, config, dtype):
    """One ``torch.optim.SGD`` step of ``net`` (train mode) on ImageNet-normalised ``x``;
    returns ``(loss, state dict after the step)`` as numpy."""
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=config.lr, momentum=config.momentum,
                          weight_decay=config.weight_decay)
    xn = torch.from_numpy(((x - MEAN) / STD).transpose(0, 3, 1, 2).copy()).to(dtype)
    loss = torch.nn.functional.cross_entropy(net(xn), torch.from_numpy(y).long())
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach()), {k: v.detach().double().numpy().copy()
                         for k, v in net.state_dict().items()}


def _small_torch_resnet(num_classes: int, seed: int):
    """torchvision-layout ResNet with one basic block per stage (every layer kind of
    ResNet-18: stem, strided and identity shortcuts, BN, head; half its compile time)."""
    net = TorchResNet(TorchBasicBlock, (1, 1, 1, 1), num_classes)
    randomize(net, seed)
    return net.eval()


def _small_resnet(tensors):
    """The Flax `ResNet` of `_small_torch_resnet` holding a state dict ``tensors``."""
    config = ResNetConfig("basic", (1, 1, 1, 1), num_classes=len(tensors["fc.bias"]))
    return fill_module(torchvision.abstract_resnet(config), tensors,
                       torchvision.resnet_table(config), "resnet (1, 1, 1, 1)")


def _flat(module, kinds):
    from flax import nnx

    leaves = [np.asarray(v, np.float64).ravel() for v in
              __import__("jax").tree.leaves(nnx.to_pure_dict(nnx.state(module, *kinds)))]
    return np.concatenate(leaves)


def test_one_step_equals_pytorch_sgd_in_train_mode():
    """Loss, the parameter update Δp = p' − p and the new running statistics of one step of
    a ResNet of ResNet-18's layers, one block per stage (batch 8, 32 px, momentum, weight
    decay, BN in training mode) equal PyTorch's,
    each within the parity tolerance of tests/parity.py (float64 PyTorch as the reference,
    float32 PyTorch measuring float32 error); the loss within 1e-5 relative."""
    from flax import nnx

    net = _small_torch_resnet(num_classes=5, seed=3)
    before = _small_resnet(state_dict_numpy(net))
    rng = np.random.default_rng(4)
    x = rng.uniform(0, 1, (8, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 5, 8).astype(np.int32)
    config = ClassifierTrainConfig(steps=10, batch_size=8, lr=0.05, momentum=0.9,
                                   weight_decay=1e-3, schedule="constant")
    state = init_state(before, config)
    params, stats, _, loss, _ = make_step(before, config)(state.params, state.batch_stats,
                                                          state.opt_state, x, y)
    after = trained_module(before, type(state)(params, stats, None, 1))
    loss64, sd64 = _torch_step(float64_copy(net), x, y, config, torch.float64)
    loss32, sd32 = _torch_step(net, x, y, config, torch.float32)
    ref64, ref32 = _small_resnet(sd64), _small_resnet(sd32)
    assert float(loss) == pytest.approx(loss64, rel=1e-5)
    start = _flat(before, (nnx.Param,))
    assert_parity(_flat(after, (nnx.Param,)) - start, _flat(ref64, (nnx.Param,)) - start,
                  _flat(ref32, (nnx.Param,)) - start, "one SGD step: Δ parameters")
    assert_parity(_flat(after, (nnx.BatchStat,)), _flat(ref64, (nnx.BatchStat,)),
                  _flat(ref32, (nnx.BatchStat,)), "one SGD step: running statistics")
    # The step changed what it should: a step that did nothing would also "match" nothing.
    assert np.abs(_flat(after, (nnx.Param,)) - start).max() > 1e-3


def test_a_new_head_is_drawn_like_torch_linear_and_settings_are_checked():
    net = torch_resnet("resnet18", num_classes=5, seed=3)
    module = torchvision.resnet_from_state_dict("resnet18", state_dict_numpy(net))
    assert set_classes(module, 5, seed=0).fc.out_features == 5  # unchanged
    module = set_classes(module, 7, seed=0)
    kernel, bias = np.asarray(module.fc.kernel[...]), np.asarray(module.fc.bias[...])
    assert kernel.shape == (512, 7) and module.config.num_classes == 7
    bound = 1 / np.sqrt(512)
    assert np.abs(kernel).max() <= bound and np.abs(bias).max() <= bound
    # U(−b, b): variance b²/3 (3584 draws; 5 standard errors ≈ 12 %: failure < 1e-6).
    assert kernel.var() == pytest.approx(bound**2 / 3, rel=0.12)
    with pytest.raises(ConfigError, match="batch_size=1: must be an integer ≥ 2"):
        ClassifierTrainConfig(batch_size=1)
    with pytest.raises(ConfigError, match="schedule='step': must be cosine or constant"):
        ClassifierTrainConfig(schedule="step")


def _tiny_data():
    """24 images of 3 classes told apart by their mean colour (learnable), 16 px."""
    rng = np.random.default_rng(5)
    y = np.repeat(np.arange(3), 8).astype(np.int32)
    x = rng.uniform(0, 0.5, (24, 16, 16, 3)).astype(np.float32)
    x[np.arange(24), :, :, y] += 0.5
    return x, y


def _batches(x, y, size=4):
    def batches(epoch, start):
        order = np.random.default_rng([0, epoch]).permutation(len(y))
        for b in range(start, len(y) // size):
            idx = order[b * size:(b + 1) * size]
            yield {"image": x[idx], "label": y[idx]}
    return batches


def test_an_interrupted_run_resumes_to_the_same_parameters_and_the_loss_falls(tmp_path):
    """12 steps (2 epochs) straight and 5 + Ctrl-C + 7 resumed give bit-identical weights
    (CPU); the training loss of the last three steps is below half that of the first two;
    the result loads as a classifier; a finished or foreign directory and other settings are
    refused naming ``out``."""
    import jax
    from flax import nnx

    from cbcert.io.registry import load_converted
    from cbcert.models.resnet import ResNet, ResNetConfig
    from cbcert.training.classifier_run import run

    def module():
        return ResNet(ResNetConfig("basic", (1, 1, 1, 1), num_classes=10), rngs=nnx.Rngs(0))

    x, y = _tiny_data()
    config = ClassifierTrainConfig(steps=12, batch_size=4, lr=0.01)
    common = dict(num_classes=3, identity={"data": "tiny"}, save_every=2, log=lambda _: None)
    losses = []
    straight = run(module(), "resnet18", _batches(x, y), 6, config, tmp_path / "a",
                   on_step=lambda s, logs: losses.append(logs["loss"]), **common)
    assert straight["steps"] == 12 and np.mean(losses[-3:]) < 0.5 * np.mean(losses[:2])

    def stop(step, _):
        if step == 5:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        run(module(), "resnet18", _batches(x, y), 6, config, tmp_path / "b", on_step=stop,
            **common)
    with pytest.raises(ConfigError, match="unfinished run with train.lr=0.01, not 0.1"):
        run(module(), "resnet18", _batches(x, y), 6, ClassifierTrainConfig(
            steps=12, batch_size=4, lr=0.1), tmp_path / "b", **common)
    resumed = run(module(), "resnet18", _batches(x, y), 6, config, tmp_path / "b", **common)
    assert resumed["params_sha256"] == straight["params_sha256"]
    apply_fn, params, manifest = load_converted(tmp_path / "b")
    assert manifest["config"]["num_classes"] == 3
    assert np.asarray(jax.jit(apply_fn)(params, x[:2])).shape == (2, 3)
    with pytest.raises(ConfigError, match="already holds a trained classifier"):
        run(module(), "resnet18", _batches(x, y), 6, config, tmp_path / "b", **common)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a classifier run"):
        run(module(), "resnet18", _batches(x, y), 6, config, tmp_path / "c", **common)


def test_an_attribute_labeler_step_equals_pytorch_bce_with_logits():
    """target="attributes": one step with BCEWithLogitsLoss (mean over images × attributes)
    equals PyTorch's, Δ parameters within the parity tolerance, loss within 1e-5."""
    from flax import nnx

    net = _small_torch_resnet(num_classes=6, seed=7)
    before = _small_resnet(state_dict_numpy(net))
    rng = np.random.default_rng(8)
    x = rng.uniform(0, 1, (4, 32, 32, 3)).astype(np.float32)
    t = rng.integers(0, 2, (4, 6)).astype(np.float32)
    config = ClassifierTrainConfig(steps=5, batch_size=4, lr=0.05, schedule="constant",
                                   target="attributes")
    state = init_state(before, config)
    params, stats, _, loss, accuracy = make_step(before, config)(
        state.params, state.batch_stats, state.opt_state, x, t)
    after = trained_module(before, type(state)(params, stats, None, 1))

    def torch_step(model, dtype):
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        xn = torch.from_numpy(((x - MEAN) / STD).transpose(0, 3, 1, 2).copy()).to(dtype)
        out = torch.nn.functional.binary_cross_entropy_with_logits(
            model(xn), torch.from_numpy(t).to(dtype))
        opt.zero_grad()
        out.backward()
        opt.step()
        return float(out.detach()), _small_resnet({
            k: v.detach().double().numpy().copy() for k, v in model.state_dict().items()})

    loss64, ref64 = torch_step(float64_copy(net), torch.float64)
    _, ref32 = torch_step(net, torch.float32)
    assert float(loss) == pytest.approx(loss64, rel=1e-5) and 0 <= float(accuracy) <= 1
    start = _flat(before, (nnx.Param,))
    assert_parity(_flat(after, (nnx.Param,)) - start, _flat(ref64, (nnx.Param,)) - start,
                  _flat(ref32, (nnx.Param,)) - start, "attribute labeler step: Δ parameters")
