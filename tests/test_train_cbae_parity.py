"""One ``certify train cbae`` step equals the same step in PyTorch, on a StyleGAN2 world.

The PyTorch side is written from the CB-AE paper's recipe (Kulkarni et al., CVPR 2025) on the
modules users bring: test_convert_stylegan2's reference StyleGAN2 (mapping with truncation,
synthesis with its constant noise) and an upstream-layout CB-AE (``encoder``/``decoder``
``Sequential`` MLPs with batch norm, logits in upstream's bin order ``[absent, present]``),
both converted to cbcert by its converters, the batch norms in training mode, and two
``torch.optim.Adam`` (betas 0.5, 0.99): (1) latent MSE + image MSE + the thresholded concept
cross-entropy, (2) one concept set by upstream's swap, the labeler's and the encoder's
cross-entropy against the intervened labels. The labeler is the same fixed linear function of
the image in both frameworks. The step's latents, concept and value come from the JAX key; the
PyTorch step is given the same ones."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
F = torch.nn.functional

import jax  # noqa: E402
import test_convert_stylegan2 as sg_ref  # noqa: E402
import yaml  # noqa: E402
from flax import nnx  # noqa: E402
from test_convert_stylegan2 import fake_upstream_modules  # noqa: E402, F401 (autouse: pickling)

from cbcert.convert import read_module  # noqa: E402
from cbcert.generators.stylegan2.generator import stylegan2_generator  # noqa: E402
from cbcert.training import cbae as tc  # noqa: E402

DW, BINS, PSI, BATCH = 10, [2, 2, 2, 4], 0.7, 8  # K = 3 binary concepts, U = 4
K = 3


def torch_cbae(seed: int) -> torch.nn.Module:
    def mlp(din, dout):
        layers = []
        for i in range(3):
            layers += [torch.nn.Linear(din if i == 0 else DW, DW), torch.nn.LeakyReLU(0.1),
                       torch.nn.BatchNorm1d(DW)]
        return torch.nn.Sequential(*layers, torch.nn.Linear(DW, dout))

    torch.manual_seed(seed)
    cbae = torch.nn.Module()
    cbae.encoder, cbae.decoder = mlp(DW, sum(BINS)), mlp(sum(BINS), DW)
    return cbae


def to_cbcert(cbae: torch.nn.Module, num_ws: int, directory):
    torch.save(cbae.state_dict(), directory / "cbae.pt")
    concepts = {"concept_bins": BINS, "concept_names": ["a", "b", "c", "unknown"],
                "types": ["bin", "bin", "bin", "cat"]}
    (directory / "cbae.yaml").write_text(yaml.safe_dump(
        {"model": {"latent_noise_dim": DW, "num_ws": num_ws, "concepts": concepts}}))
    module, _ = read_module("cbae", directory / "cbae.pt", config_path=directory / "cbae.yaml")
    return module


def test_one_step_equals_pytorch(tmp_path):
    """The five losses within 1e-5 relative (1e-6 absolute; the two intervention losses, taken
    after the first Adam step, also 2·lr·Σ|∂loss/∂θ| over the weights whose first-phase gradient
    is ≤ 1e-6, which that step may move in opposite directions); every running mean within 2e-5;
    every CB-AE parameter whose gradient exceeds 1e-6 in both phases within 2e-5 of PyTorch's
    after the step but at most 0.2 % of them (1 of ~950 when written); every parameter within
    the two Adam steps' bound 2·lr (float32; each step moves a weight by up to lr = 2e-4).
    Deterministic: fixed weights, key and latents."""
    reference = sg_ref.Generator(**sg_ref.MAIN).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    sg_ref.write_snapshot(reference, tmp_path / "g.pkl")
    model, _ = read_module("stylegan2", tmp_path / "g.pkl")
    generator = stylegan2_generator(model, None, PSI)
    num_ws = reference.num_ws
    cbae_t = torch_cbae(seed=3).train()
    cbae_j = to_cbcert(cbae_t, num_ws, tmp_path)
    cbae_j.set_attributes(use_running_average=True)

    h, w = generator.image_shape[:2]
    rng = np.random.default_rng(4)
    pattern = rng.choice([-1.0, 1.0], size=(K, h * w * 3)).astype(np.float32)

    def labeler(x):  # x[B, H, W, 3] -> s[B, K]: a fixed linear function, centred at 0.5
        return 0.05 * (x.reshape(x.shape[0], -1) - 0.5) @ pattern.T

    config = tc.CBAETrainConfig(steps=1, batch_size=BATCH, num_unsup=4, threshold=0.6)
    state = tc.init_state(cbae_j, config)
    step = tc.make_step(generator, labeler, cbae_j, config)
    key = jax.random.key(11)
    (params, stats, _, _), logs = step((state.params, state.batch_stats, state.opt_recon,
                                        state.opt_interv), key)
    key_z, key_concept, key_value = jax.random.split(key, 3)
    z = np.asarray(generator.sample_inputs(key_z, BATCH))
    concept = int(jax.random.randint(key_concept, (), 0, K))
    value = bool(jax.random.bernoulli(key_value))

    # PyTorch: the same step.
    def g2(ws):  # [B, num_ws, DW] -> images [B, H, W, 3] in [0, 1]
        return ((reference.synthesis(ws) + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1)

    def label_t(x):
        return 0.05 * (x.reshape(x.shape[0], -1) - 0.5) @ torch.from_numpy(pattern).T

    def pairs(logits):  # upstream logits -> [B, K, 2] ([absent, present])
        return logits[:, :2 * K].reshape(-1, K, 2)

    def pair_ce(pair_logits, labels):  # -> [B, K]
        return F.cross_entropy(pair_logits.reshape(-1, 2), labels.reshape(-1),
                               reduction="none").reshape(-1, K)

    def tiled(w_one):
        return w_one[:, None, :].expand(-1, num_ws, -1)

    betas = (config.beta1, config.beta2)
    adam_a = torch.optim.Adam(cbae_t.parameters(), lr=config.recon_lr, betas=betas)
    adam_b = torch.optim.Adam(cbae_t.parameters(), lr=config.interv_lr, betas=betas)
    tiny_grad = 1e-6  # a gradient at most this small: Adam's first step may move it either way
    with torch.no_grad():
        ws = reference.mapping(torch.from_numpy(z.copy()), PSI, None)
        x = g2(ws)
        s = label_t(x)
    labels = (s > 0).long()
    keep = torch.sigmoid(s.abs()) >= config.threshold
    logits = cbae_t.encoder(ws.mean(dim=1))
    ws_rec = tiled(cbae_t.decoder(logits))
    latent = ((ws_rec - ws) ** 2).mean()
    image = ((g2(ws_rec) - x) ** 2).mean()
    ce = pair_ce(pairs(logits), labels)
    kept = keep.sum(dim=0)
    concept_loss = ((ce * keep).sum(dim=0) / kept.clamp(min=1)).sum() * bool((kept > 0).all())
    adam_a.zero_grad()
    (latent + image + concept_loss).backward()
    smallest = {n: q.grad.abs().clone() for n, q in cbae_t.named_parameters()}
    adam_a.step()

    c = cbae_t.encoder(ws.mean(dim=1)).detach()
    absent, present = c[:, 2 * concept].clone(), c[:, 2 * concept + 1].clone()
    high, low = torch.maximum(absent, present), torch.minimum(absent, present)
    c[:, 2 * concept + 1] = high if value else low
    c[:, 2 * concept] = low if value else high
    target = labels.clone()
    target[:, concept] = int(value)
    w_new = cbae_t.decoder(c)
    c_new = cbae_t.encoder(w_new)
    s_new = label_t(g2(tiled(w_new)))
    i1 = pair_ce(torch.stack([torch.zeros_like(s_new), s_new], dim=-1), target).mean(0).sum()
    i2 = pair_ce(pairs(c_new), target).mean(0).sum()
    # The intervention losses are taken at the weights after the first Adam step, where a weight
    # whose reconstruction gradient is ~0 moves by about lr·sign(g): the two frameworks may move
    # it in opposite directions (2·lr apart; see the weight checks below). To first order that
    # moves a loss by at most 2·lr·Σ|∂loss/∂θ| over those weights: their share of the tolerance.
    tiny = [q.grad.abs() <= tiny_grad for q in cbae_t.parameters()]
    slack = {}
    for name, loss in (("interv_image", i1), ("interv_latent", i2)):
        grads = torch.autograd.grad(loss, list(cbae_t.parameters()), retain_graph=True,
                                    allow_unused=True)
        slack[name] = sum(float((g.abs() * t).sum()) for g, t in zip(grads, tiny, strict=True)
                          if g is not None) * 2 * config.recon_lr
    adam_b.zero_grad()
    (i1 + i2).backward()
    smallest = {n: torch.minimum(smallest[n], q.grad.abs()) for n, q in cbae_t.named_parameters()}
    adam_b.step()

    expected = {"latent": latent, "image": image, "concept": concept_loss, "interv_image": i1,
                "interv_latent": i2}
    for name, value_t in expected.items():
        np.testing.assert_allclose(float(logs[name]), value_t.item(), rtol=1e-5,
                                   atol=1e-6 + slack.get(name, 0.0), err_msg=name)
    assert 0 < float(keep.float().mean()) < 1  # the threshold masks some labels, not all

    theirs = flat(to_cbcert(cbae_t.eval(), num_ws, tmp_path))
    mine = flat(tc.trained_module(cbae_j, tc.TrainState(params, stats, None, None, 1)))
    # PyTorch's smaller gradient magnitude of the two phases, in cbcert's layout: a copy of the
    # CB-AE holding it as its parameters, converted like the weights.
    copy = torch_cbae(seed=3)
    with torch.no_grad():
        for n, q in copy.named_parameters():
            q.copy_(smallest[n])
    gradient = flat(to_cbcert(copy.eval(), num_ws, tmp_path))
    assert mine.keys() == theirs.keys()
    flipped = total = 0
    for path, a in mine.items():
        b = theirs[path]
        if path[-1] == "var":
            continue  # flax's running variance uses the biased batch variance (module docs)
        if path[-1] == "mean":
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5, err_msg=str(path))
            continue
        # Adam's first step is lr·g/(|g| + 1e-8), about lr·sign(g): where a phase's |g| is
        # within ~100 ε of zero the step is float rounding (there only the two steps' bound
        # 2·lr holds), and a non-smooth point (the synthesis clamp, the image clip, LeakyReLU
        # at 0) falling on the other side in float32 can flip a small gradient's sign: rare.
        assert np.all(np.abs(a - b) <= 2 * (config.recon_lr + config.interv_lr)), path
        sharp = gradient[path] > tiny_grad
        flipped += int((sharp & ~np.isclose(a, b, rtol=1e-4, atol=2e-5)).sum())
        total += int(sharp.sum())
    assert flipped <= 0.002 * total, (flipped, total)


def flat(module) -> dict:
    """``{path of names: float array}`` of a module's state."""
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(module)))
    return {tuple(str(getattr(k, "key", k)) for k in path): np.asarray(v) for path, v in leaves}
