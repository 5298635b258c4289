"""Pixel-space worlds (`cbcert.worlds.pixels`): Cohen et al.'s setting on user images.

The parity test feeds a PyTorch loop written like the reference ``Smooth._sample_noise``
(locuslab/smoothing ``core.py``: repeat the image, add ``σ ε``, classify, bincount) with the
*same* noise the engine draws, and checks the counts, then the radii against the reference
formula ``σ Φ⁻¹(proportion_confint(nA, n, alpha=2α, method="beta")[0])``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import struct
import zipfile
import zlib

import jax
import numpy as np
import pytest
from click.testing import CliRunner
from scipy.stats import beta, norm

import cbcert
from cbcert.cli import main
from cbcert.engine.keys import Stream, sample_key, stream_key
from cbcert.engine.noise import Gaussian
from cbcert.runs.directory import RECORDS
from cbcert.schema import ConfigError
from cbcert.worlds.pixels import NORMALIZE, ImagesError, read_images

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from test_convert_resnet import torch_resnet  # noqa: E402

SIZE, CLASSES = 32, 10


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """A converted ResNet-18 (random weights), its torch twin and a 4-image npz."""
    root = tmp_path_factory.mktemp("pixels")
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (4, SIZE, SIZE, 3)).astype(np.float32)
    y = np.array([3, 1, 4, 1])
    model = torch_resnet("resnet18", num_classes=CLASSES, seed=7)
    # A random ResNet's embedding barely moves with its input (std ~1e-3 of its mean), so every
    # noisy sample would get the same class and the comparison would prove little: centre the
    # head on the mean clean embedding and amplify it, so the counts spread over classes.
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in NORMALIZE["cifar10"])
    with torch.no_grad():
        clean = torch.from_numpy(x.transpose(0, 3, 1, 2).copy())
        centre = model.embed((clean - mean) / std).mean(0)
        model.fc.weight.mul_(300.0)
        model.fc.bias.copy_(-model.fc.weight @ centre)
    torch.save(model.state_dict(), root / "r18.pth")
    from cbcert.convert import convert

    convert("resnet18", root / "r18.pth", root / "r18")
    np.savez(root / "data.npz", x=x, y=y)
    return {"root": root, "torch": model, "classifier": root / "r18", "images": root / "data.npz",
            "x": x, "y": y}


def _reference_counts(model, x_nhwc, noise_nhwc, num, batch_size, mean, std):
    """locuslab/smoothing ``Smooth._sample_noise`` with the noise passed in (not drawn)."""
    x = torch.from_numpy(x_nhwc.transpose(2, 0, 1).copy())
    noise = torch.from_numpy(noise_nhwc.transpose(0, 3, 1, 2).copy())
    mean = torch.tensor(mean).view(1, 3, 1, 1)
    std = torch.tensor(std).view(1, 3, 1, 1)
    counts = np.zeros(CLASSES, np.int64)
    remaining, start = num, 0
    with torch.no_grad():
        while remaining > 0:
            this_batch = min(batch_size, remaining)
            batch = x.repeat((this_batch, 1, 1, 1))
            noisy = batch + noise[start:start + this_batch]
            predictions = model((noisy - mean) / std).argmax(1)  # NormalizeLayer, then f
            counts += np.bincount(predictions.numpy(), minlength=CLASSES)
            remaining -= this_batch
            start += this_batch
    return counts


def test_counts_and_radii_match_the_reference_loop_fed_the_same_noise(parts):
    sigma, n0, n, alpha, seed = 0.12, 16, 200, 0.001, 5
    world = cbcert.load_world(f"pixels:{parts['images']}", classifier=parts["classifier"],
                              normalize="cifar10")
    assert world.model_names == ("std",) and world.generator.latent_dim == SIZE * SIZE * 3
    smoothed = cbcert.smooth(world.latent_apply(("std",)), world.params, cbcert.gaussian(sigma))
    z = world.dataset.latents
    key = jax.random.key(seed)
    cert = smoothed.certify(z, key, n0=n0, n=n, alpha=alpha)
    cert = dataclasses.replace(cert, **{f.name: getattr(cert, f.name)[:, 0]  # one head
                                        for f in dataclasses.fields(cert)})
    select = smoothed.counts(z, key, n0, stream=Stream.SELECT)[:, 0]
    estimate = smoothed.counts(z, key, n)[:, 0]
    mean, std = NORMALIZE["cifar10"]
    for i in range(len(z)):
        for stream, num, ours in ((Stream.SELECT, n0, select), (Stream.ESTIMATE, n, estimate)):
            # σ ε exactly as the engine draws it: Gaussian.perturb of a zero image.
            draw = jax.vmap(lambda j, i=i, stream=stream: Gaussian().perturb(
                sample_key(stream_key(key, stream), i, j), np.zeros(z.shape[1], np.float32),
                sigma))
            noise = np.asarray(draw(np.arange(num))).reshape(num, SIZE, SIZE, 3)
            reference = _reference_counts(parts["torch"], parts["x"][i], noise, num, 40,
                                          mean, std)
            np.testing.assert_array_equal(ours[i], reference, err_msg=f"input {i} {stream}")
        top = int(np.argmax(select[i]))
        n_a = int(estimate[i, top])
        p_bar = beta.ppf(alpha, n_a, n - n_a + 1) if n_a > 0 else 0.0  # proportion_confint
        if p_bar < 0.5:
            assert cert.prediction[i] == cbcert.ABSTAIN and np.isnan(cert.radius[i])
        else:
            assert cert.prediction[i] == top
            # σ of the certificate: min(typed, drawn float32) (SPEC §4); float32(0.12) < 0.12.
            drawn = min(sigma, float(np.float32(sigma)))
            np.testing.assert_allclose(cert.radius[i], drawn * norm.ppf(p_bar), rtol=1e-12)
    # The comparison means something: classes vary within and across inputs.
    assert (estimate.max(-1) < n).all() and len(set(np.argmax(estimate, -1))) > 1
    assert (cert.prediction != cbcert.ABSTAIN).any()


def _certify(tmp_path, images, classifier, *extra, out="run"):
    args = ["latent", "--world", f"pixels:{images}", "--classifier", str(classifier),
            "--sigma", "0.25", "--n0", "8", "--n", "48", "--alpha", "0.01", "--inputs", "4",
            "--out", str(tmp_path / out), "--quiet", *extra]
    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_cli_records_labels_units_and_cohen_export(parts, tmp_path):
    result = _certify(tmp_path, parts["images"], parts["classifier"], "--export", "cohen",
                      "--normalize", "cifar10")
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (tmp_path / "run" / RECORDS).read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    assert [r["label"] for r in records] == parts["y"].tolist()
    assert all(r["true_label"] == r["label"] for r in records)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["world"] == "pixels:data.npz"
    assert run["world_identity"]["units"].startswith("pixel values on [0, 1]")
    assert run["world_identity"]["normalize"] == "cifar10"
    lines = (tmp_path / "run" / "cohen-std.tsv").read_text().splitlines()
    assert lines[0].split("\t") == ["idx", "label", "predict", "radius", "correct", "time"]
    for line, record in zip(lines[1:], records, strict=True):
        idx, label, predict, radius, correct, elapsed = line.split("\t")
        assert (int(idx), int(label), int(predict)) == (record["index"], record["label"],
                                                        record["prediction"])
        assert float(radius) == (record["radius"] if record["radius"] is not None else 0.0)
        assert int(correct) == int(record["prediction"] == record["label"])
        assert elapsed.startswith("0:00:")
    # Other images under the same --out: refused, the finished run is kept.
    other = tmp_path / "other.npz"
    np.savez(other, x=parts["x"][::-1], y=parts["y"])
    again = _certify(tmp_path, other, parts["classifier"])
    assert again.exit_code == 2 and "different settings" in again.output
    assert (tmp_path / "run" / RECORDS).read_text().count("\n") == 4


def test_png_folder_reads_like_the_npz(parts, tmp_path):
    from PIL import Image

    pixels = (parts["x"] * 255).round().astype(np.uint8)
    lines = []
    for i, image in enumerate(pixels):
        Image.fromarray(image).save(tmp_path / f"img{i}.png")
        lines.append(f"img{i}.png {parts['y'][i]}")
    (tmp_path / "labels.txt").write_text("# file label\n" + "\n".join(lines) + "\n")
    x, y = read_images(tmp_path)
    np.testing.assert_array_equal(x, pixels.astype(np.float32) / 255)
    np.testing.assert_array_equal(y, parts["y"])
    (tmp_path / "labels.txt").write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(ImagesError, match=r"labels.txt: no label for \['img3.png'\]"):
        read_images(tmp_path)


def _bad_npz(path, **arrays):
    np.savez(path, **arrays)
    return path


def _truncated_npz(path, x, y):
    np.savez(path, x=x, y=y)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def _npz_declaring(path, shape, y):
    """An .npz whose x header declares ``shape`` (uint8) but holds no pixel data."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False,
                                                  "shape": shape})
    labels = io.BytesIO()
    np.save(labels, y)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", header.getvalue())
        archive.writestr("y.npy", labels.getvalue())
    return path


def _fifo(path, *_):
    os.mkfifo(path)
    return path


@pytest.mark.parametrize(("name", "make", "message"), [
    ("shape", lambda p, x, y: _bad_npz(p, x=x[..., 0], y=y), r"x has shape \(4, 32, 32\)"),
    ("range", lambda p, x, y: _bad_npz(p, x=x * 2, y=y), r"values outside \[0, 1\]"),
    ("nan", lambda p, x, y: _bad_npz(p, x=np.where(x > 0.99, np.nan, x), y=y), "NaN"),
    ("label", lambda p, x, y: _bad_npz(p, x=x, y=y + 7), r"label 10 of image 0 is out of range"),
    ("labels", lambda p, x, y: _bad_npz(p, x=x, y=y[:3]), r"y has shape \(3,\)"),
    ("keys", lambda p, x, y: _bad_npz(p, images=x, y=y), r"missing array\(s\) \['x'\]"),
    ("missing", lambda p, x, y: p, "no such file or directory"),
    ("garbage", lambda p, x, y: (p.write_bytes(b"not a zip"), p)[1], "not a readable .npz"),
    ("uint64", lambda p, x, y: _bad_npz(p, x=x, y=np.array([3, 1, 2**63, 1], np.uint64)),
     r"label 9223372036854775808 of image 2 is out of range"),
    ("truncated", _truncated_npz, "not a readable .npz"),
    ("huge", lambda p, x, y: _npz_declaring(p, (1, 8192, 8192, 3), y[:1]),
     r"x holds images of 8192 × 8192 pixels; at most 16777216 \(4096 × 4096\)"),
    ("fifo", _fifo, r"not a regular file \(a FIFO\)"),
])
def test_bad_images_exit_2_naming_file_and_problem(parts, tmp_path, name, make, message):
    path = make(tmp_path / f"{name}.npz", parts["x"], parts["y"])
    result = _certify(tmp_path, path, parts["classifier"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"{name}.npz" in text and "--world" in text
    assert len(__import__("re").findall(message, text)) == 1, text


def test_pixels_worlds_are_refused_where_they_do_not_apply(parts, tmp_path):
    world = ["--world", f"pixels:{parts['images']}", "--classifier", str(parts["classifier"])]
    runner = CliRunner()
    concept = runner.invoke(main, ["concept", "--rho", "0.2", *world, "--out",
                                   str(tmp_path / "c")])
    assert concept.exit_code == 2 and "no concept bottleneck" in concept.output
    perturb = runner.invoke(main, ["perturb", "--world", f"pixels:{parts['images']}", "--out",
                                   str(tmp_path / "p")])
    assert perturb.exit_code == 2 and "pixels worlds work with certify latent" in perturb.output
    no_classifier = runner.invoke(main, ["latent", "--sigma", "0.1", "--world",
                                         f"pixels:{parts['images']}", "--out",
                                         str(tmp_path / "n")])
    assert no_classifier.exit_code == 2 and "needs a classifier" in no_classifier.output
    assert "Invalid value for --classifier" in no_classifier.output  # the key's flag
    with pytest.raises(ConfigError, match="needs a classifier") as caught:
        cbcert.load_world(f"pixels:{parts['images']}")
    assert caught.value.key == "classifier" and "--" not in str(caught.value)
    stray = runner.invoke(main, ["latent", "--sigma", "0.1", "--classifier",
                                 str(parts["classifier"]), "--out", str(tmp_path / "s")])
    assert stray.exit_code == 2 and "--classifier applies to --world pixels" in stray.output
    with pytest.raises(ImagesError, match="no such file"):
        read_images(tmp_path / "absent.npz")


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width × height`` RGB pixels and holds none (decoding fails)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2,
                                                                  0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def _fifo_in_place(path):
    path.unlink()
    os.mkfifo(path)


@pytest.mark.parametrize(("name", "spoil", "message"), [
    ("label overflow", lambda d: (d / "labels.txt").write_text("img0.png 3\nimg1.png "
                                                               "99999999999999999999\n"),
     r"labels.txt: line 2: label 99999999999999999999 is out of range"),
    ("bomb", lambda d: (d / "img1.png").write_bytes(_png_header(20000, 20000)),
     r"img1.png: Image size \(400000000 pixels\) exceeds limit .*; at most 16777216 "
     r"\(4096 × 4096\)"),
    ("huge", lambda d: (d / "img1.png").write_bytes(_png_header(5000, 4000)),
     r"img1.png: 5000 × 4000 pixels; at most 16777216"),
    ("fifo png", lambda d: _fifo_in_place(d / "img1.png"),
     r"img1.png: not a regular file \(a FIFO\)"),
    ("fifo labels", lambda d: _fifo_in_place(d / "labels.txt"),
     r"labels.txt: not a regular file \(a FIFO\)"),
])
def test_bad_png_folder_is_refused_naming_file_and_problem(tmp_path, name, spoil, message):
    """Checked from the file's type and the PNG header: a FIFO is never opened for reading
    (it would wait for a writer) and a huge image is never decoded."""
    from PIL import Image

    for i in range(2):
        Image.fromarray(np.full((4, 4, 3), 40 * i, np.uint8)).save(tmp_path / f"img{i}.png")
    (tmp_path / "labels.txt").write_text("img0.png 3\nimg1.png 1\n")
    spoil(tmp_path)
    with pytest.raises(ImagesError, match=message):
        read_images(tmp_path)
