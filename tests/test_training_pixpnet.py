"""The PixPNet trainer: one step of each phase equals PyTorch's (the ProtoNet reference of
``test_convert_pixpnet``, its losses written from ProtoPNet's paper, ``torch.optim.Adam`` with
its parameter groups), the push lands every prototype on a patch of its own class, and an
interrupted ``certify train pixpnet`` resumes to the same parameters."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
F = torch.nn.functional

from test_convert_pixpnet import make_reference, resnet18_layers, save_lightning  # noqa: E402

from cbcert.convert import pixpnet as convert_pixpnet  # noqa: E402
from cbcert.models.pixpnet import PixPNetConfig  # noqa: E402
from cbcert.schema import ConfigError  # noqa: E402
from cbcert.training import pixpnet as T  # noqa: E402
from cbcert.training.classifier import IMAGENET_MEAN, IMAGENET_STD  # noqa: E402

CONFIG = PixPNetConfig("resnet18", "layer2", num_prototypes=8, prototype_dim=16, num_classes=4)


def torch_step(reference, phase, x, y, config: T.PixPNetTrainConfig):
    """One step of ``phase`` in PyTorch: the loss of the trainer's module docstring on the
    reference in training mode, Adam with ProtoPNet's parameter groups. Returns the loss."""
    groups = {"warm": [(reference.add_on_layers.parameters(), config.lr_add_on,
                        config.weight_decay),
                       ([reference.prototype_vectors], config.lr_prototypes, 0.0)],
              "joint": [(reference.features.parameters(), config.lr_features,
                         config.weight_decay),
                        (reference.add_on_layers.parameters(), config.lr_add_on,
                         config.weight_decay),
                        ([reference.prototype_vectors], config.lr_prototypes, 0.0)],
              "last": [(reference.last_layer.parameters(), config.lr_last, 0.0)]}[phase]
    adam = torch.optim.Adam([{"params": list(p), "lr": lr, "weight_decay": wd}
                             for p, lr, wd in groups])
    reference.train()
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    xt = (torch.from_numpy(x).permute(0, 3, 1, 2) - mean) / std
    z = reference.add_on_layers(reference.features(xt))
    protos = reference.prototype_vectors
    xp = F.conv2d(z, protos)
    d = F.relu(F.conv2d(z * z, reference.ones) - (xp + xp)
               + (protos ** 2).sum(dim=(1, 2, 3)).view(-1, 1, 1))
    d = -F.max_pool2d(-d, kernel_size=d.shape[2:]).flatten(1)  # [B, P]
    logits = reference.last_layer(torch.log(1 / (d + 1e-6) + 1))
    yt = torch.from_numpy(y).long()
    identity = reference.prototype_class_identity[:, yt].T.bool()  # [B, P]
    cluster = torch.where(identity, d, torch.inf).min(dim=1).values.mean()
    separation = torch.where(identity, torch.inf, d).min(dim=1).values.mean()
    wrong = 1 - reference.prototype_class_identity.T  # [C, P]
    loss = (F.cross_entropy(logits, yt) + config.clst * cluster - config.sep * separation
            + config.l1 * (reference.last_layer.weight * wrong).abs().sum())
    adam.zero_grad()
    loss.backward()
    stepped = {id(q) for group in adam.param_groups for q in group["params"]}
    grads = {name: q.grad if q.grad is not None else torch.zeros_like(q)
             for name, q in reference.named_parameters()}
    decay = {id(q): group["weight_decay"] for group in adam.param_groups
             for q in group["params"]}
    grads = {name: (grads[name] + decay[id(q)] * q.detach()) if id(q) in stepped
             else torch.zeros_like(q) for name, q in reference.named_parameters()}
    adam.step()
    return loss.item(), grads


def flat(state) -> dict:
    """``{path of names: float array}`` of an NNX state."""
    import jax

    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))
    return {tuple(str(getattr(k, "key", k)) for k in path): np.asarray(v) for path, v in leaves}


def converted(reference, tmp_path, name):
    directory = tmp_path / name
    directory.mkdir()
    module, _ = convert_pixpnet.pixpnet_from_checkpoint(
        *save_lightning(reference.eval(), CONFIG, directory))
    return module


@pytest.mark.parametrize("phase", T.PHASES)
def test_one_step_of_each_phase_equals_pytorch(phase, tmp_path):
    """Loss within 1e-5 relative; every parameter and running statistic after the step within
    2e-5 of PyTorch's (float32 rounding through a ResNet-18 trunk and one Adam step of size
    ≤ lr); the frozen groups unchanged."""
    from test_convert_resnet import images

    config = T.PixPNetTrainConfig()
    reference = make_reference(CONFIG, resnet18_layers(CONFIG.feature_layer), seed=5)
    module = converted(reference, tmp_path, "before")
    x = images(8, 32, seed=6)
    y = np.array([0, 1, 2, 3, 0, 1, 2, 3], np.int32)
    state = T.init_state(module, config)
    step = T.make_step(module, config, phase)
    params, stats, _, loss, _ = step(state.params, state.batch_stats, state.opt_states[phase],
                                     x, y)
    expected, grads = torch_step(reference, phase, x, y, config)
    assert abs(float(loss) - expected) <= 1e-5 * abs(expected)
    after = T.trained_module(module, T.TrainState(params, stats, state.opt_states, 1))
    want = converted(reference, tmp_path, "after")
    # PyTorch's gradients (weight decay included) in the module's layout: a copy of the
    # reference holding them as its parameters, converted like the weights.
    with torch.no_grad():
        for name, q in reference.named_parameters():
            q.copy_(grads[name])
    gradient = flat(nnx.state(converted(reference, tmp_path, "grads"), nnx.Param))
    mine, theirs = flat(nnx.state(after)), flat(nnx.state(want))
    before = flat(nnx.state(module))
    assert mine.keys() == theirs.keys() == before.keys()
    moved = {"warm": ("add_on", "prototypes"), "joint": ("backbone", "add_on", "prototypes"),
             "last": ("readout",)}[phase]
    loose = total = 0
    for path, a in mine.items():
        b, c = theirs[path], before[path]
        # Adam's first step is lr·g/(|g| + 1e-8): where |g| is within ~100 ε of zero its size
        # is float rounding, so there only the step's bound |Δ| ≤ 2·max lr is asserted.
        g = gradient.get(path)
        sharp = np.ones(a.shape, bool) if g is None else np.abs(g) > 1e-6
        np.testing.assert_allclose(a[sharp], b[sharp], rtol=1e-4, atol=2e-5,
                                   err_msg=f"{phase}: {path}")
        assert np.all(np.abs(a - b)[~sharp] <= 2 * 3e-3)
        if path[0] in moved and g is not None:  # a trained parameter
            loose, total = loose + int((~sharp).sum()), total + a.size
        elif g is not None:  # a frozen one
            np.testing.assert_array_equal(a, c, err_msg=f"{phase}: {path}")
    assert loose <= 1e-3 * total


def test_push_puts_each_prototype_on_a_patch_of_its_class(tmp_path):
    """After the push every prototype equals the add-on output patch of a training image of
    its class nearest to it (checked by brute force over the images); a class without images
    is named."""
    from test_convert_resnet import images

    reference = make_reference(CONFIG, resnet18_layers(CONFIG.feature_layer), seed=7)
    module = converted(reference, tmp_path, "m")
    x = images(8, 32, seed=8)
    y = np.array([0, 1, 2, 3, 3, 2, 1, 0], np.int32)
    before = np.asarray(module.prototypes[...]).copy()
    mean, std = np.asarray(IMAGENET_MEAN, np.float32), np.asarray(IMAGENET_STD, np.float32)
    z = np.asarray(module.latent((x - mean) / std))  # [B, h, w, D]
    module, distances = T.push_prototypes(module, [{"image": x[:4], "label": y[:4]},
                                                   {"image": x[4:], "label": y[4:]}])
    after = np.asarray(module.prototypes[...])
    owner = T.prototype_owner(8, 4)
    for j in range(8):
        patches = z[y == owner[j]].reshape(-1, z.shape[-1])
        d = ((patches - before[j]) ** 2).sum(-1)
        # the push computed z in jitted batches of 4, here z is one eager batch of 8: the
        # same patch up to float rounding
        np.testing.assert_allclose(after[j], patches[np.argmin(d)], rtol=0, atol=1e-6)
        assert abs(distances[j] - d.min()) <= 1e-4 * max(d.min(), 1e-3)
    with pytest.raises(ConfigError, match="class 3"):
        T.push_prototypes(module, [{"image": x[:3], "label": y[:3]}])


def test_config_refuses_out_of_range_settings():
    for field, value in (("warm_steps", -1), ("lr_last", 0.0), ("joint_lr_step", 0)):
        with pytest.raises(ConfigError) as err:
            T.PixPNetTrainConfig(**{field: value})
        assert err.value.key == field
    config = T.PixPNetTrainConfig(warm_steps=2, joint_steps=3, last_steps=1)
    assert [config.phase(s) for s in range(6)] == ["warm"] * 2 + ["joint"] * 3 + ["last"]


@pytest.fixture(scope="module")
def classifier(resnet18_dir):
    from cbcert.io.registry import load_module

    return load_module(resnet18_dir)[0]


def test_new_pixpnet_keeps_the_classifiers_trunk_and_protopnets_start(classifier):
    from cbcert.training.pixpnet_run import new_pixpnet

    module = new_pixpnet(classifier, CONFIG, seed=1)
    np.testing.assert_array_equal(np.asarray(module.backbone.stages[1][0].conv1.kernel[...]),
                                  np.asarray(classifier.stages[1][0].conv1.kernel[...]))
    kernel = np.asarray(module.readout.kernel[...])  # [P, C]
    assert set(np.unique(kernel)) == {-0.5, 1.0}
    np.testing.assert_array_equal(kernel.argmax(1), T.prototype_owner(8, 4))
    prototypes = np.asarray(module.prototypes[...])
    assert prototypes.min() >= 0 and prototypes.max() < 1
    sparse = new_pixpnet(classifier, PixPNetConfig("resnet18", "layer2", 8, 16, 4,
                                                   readout_type="sparse"), seed=1)
    np.testing.assert_array_equal(np.asarray(sparse.readout_weight[...]), np.ones((4, 2)))
    dense = PixPNetConfig("densenet121", "transition1", 8, 16, 4)
    with pytest.raises(ConfigError) as err:
        new_pixpnet(classifier, dense, seed=1)
    assert err.value.key == "init"


def test_interrupted_run_resumes_bit_identically_and_the_loss_falls(classifier, tmp_path):
    """Every phase and the push: Ctrl-C in the joint phase and again just after the push, then
    the same call, gives the parameters of an uninterrupted run bit for bit. With one batch
    repeated, the warm phase's loss falls step by step (deterministic: fixed images and
    keys)."""
    from test_convert_resnet import images

    from cbcert.io import checkpoint
    from cbcert.training.pixpnet_run import new_pixpnet, run

    x = images(16, 32, seed=9)
    y = np.arange(16, dtype=np.int32) % 4

    def batches(epoch, start):
        order = np.random.default_rng([epoch]).permutation(16)
        for b in range(start, 4):
            rows = order[4 * b:4 * b + 4]
            yield {"image": x[rows], "label": y[rows]}

    def push_batches():
        return [{"image": x[:8], "label": y[:8]}, {"image": x[8:], "label": y[8:]}]

    config = T.PixPNetTrainConfig(warm_steps=3, joint_steps=3, last_steps=3, batch_size=4)
    kwargs = dict(identity={"test": 1}, save_every=4, log=lambda s: None)
    full = run(new_pixpnet(classifier, CONFIG, 1), batches, 4, push_batches, config,
               tmp_path / "a", **kwargs)
    for stop in (5, 7):
        def on_step(step, _, stop=stop):
            if step == stop:
                raise KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            run(new_pixpnet(classifier, CONFIG, 1), batches, 4, push_batches, config,
                tmp_path / "b", on_step=on_step, **kwargs)
    resumed = run(new_pixpnet(classifier, CONFIG, 1), batches, 4, push_batches, config,
                  tmp_path / "b", **kwargs)
    assert resumed["steps"] == full["steps"] == 9
    assert (checkpoint.read_manifest(tmp_path / "a")["params_sha256"]
            == checkpoint.read_manifest(tmp_path / "b")["params_sha256"])

    losses = []
    one = {"image": x[:4], "label": y[:4]}
    run(new_pixpnet(classifier, CONFIG, 1), lambda e, s: iter([one] * (4 - s)), 4,
        push_batches, config, tmp_path / "c", identity={}, save_every=100, log=lambda s: None,
        on_step=lambda step, logs: losses.append(logs["loss"]))
    assert len(losses) == 9 and losses[0] > losses[1] > losses[2]  # the warm phase
