"""The restricted unpickler against crafted files, and legitimate files still loading exactly.

Crafted files spell torch's own globals (``torch._utils._rebuild_tensor_v2``,
``torch.storage._load_from_bytes``, ``torch.FloatStorage``) with hostile arguments: views
outside their storage, wrong argument types, non-array storages, zip bombs. They are loaded in a
subprocess, so a loader that crashes (SIGSEGV from an unchecked ``as_strided``) fails the test
instead of killing pytest. Every refusal must be a ``ValueError`` naming the file and the
problem; through the CLI, exit code 2 and no traceback.
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import zipfile
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cbcert.convert import pickles  # noqa: E402
from cbcert.convert.stylegan2 import load_snapshot  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CHUNK = 1 << 24  # 16 MiB of zeros per full-flushed deflate block
BOMB_BYTES = 1 << 31  # 2 GiB inflated; the archive member is ~2 MB
PEAK_LIMIT = 1 << 30  # a loader that inflates a bomb goes past this


class Call:
    """Pickles as ``function(*args)``: a crafted REDUCE of any global."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def tensor(storage, offset, size, stride) -> Call:
    """What ``pickle`` writes for a tensor, with the view numbers chosen by the test."""
    return Call(torch._utils._rebuild_tensor_v2, storage, offset, size, stride, False,
                collections.OrderedDict())


def legacy_storage(values: torch.Tensor):
    """A storage that pickles as torch does in StyleGAN2 snapshots (``_load_from_bytes`` blob)."""
    return torch.storage.TypedStorage(wrap_storage=values.untyped_storage(), dtype=values.dtype,
                                      _internal=True)


class ZipStorage:
    """A ``data/<key>`` storage of a torch zip archive, referenced by persistent id."""

    def __init__(self, key: str, numel: int):
        self.key, self.numel = key, numel


class _ZipPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, ZipStorage):
            return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
        return None


def data_pkl(obj) -> bytes:
    buffer = io.BytesIO()
    _ZipPickler(buffer, protocol=2).dump(obj)
    return buffer.getvalue()


def write_torch_zip(path: Path, obj, storages: dict[str, bytes]) -> Path:
    """A torch.save-style archive: ``archive/data.pkl``, ``byteorder``, ``data/<key>``."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", data_pkl(obj))
        archive.writestr("archive/byteorder", "little")
        for key, data in storages.items():
            archive.writestr(f"archive/data/{key}", data)
    return path


def deflated_zeros(nbytes: int) -> bytes:
    """Raw deflate stream of ``nbytes`` zeros without compressing them all: after a full flush
    the compressor restarts, so every 16 MiB block compresses to the same bytes."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = compressor.compress(bytes(CHUNK)) + compressor.flush(zlib.Z_FULL_FLUSH)
    return block * (nbytes // CHUNK) + compressor.flush()


def zeros_crc(nbytes: int) -> int:
    crc, chunk = 0, bytes(CHUNK)
    for _ in range(nbytes // CHUNK):
        crc = zlib.crc32(chunk, crc)
    return crc


def write_raw_zip(path: Path, members: list[tuple[str, bytes, int, int, int]]) -> Path:
    """A zip written field by field, so headers can state any size.

    ``members``: ``(name, payload, method, crc, declared uncompressed size)``; ``payload`` is
    stored as given (raw deflate for method 8).
    """
    body, directory = bytearray(), bytearray()
    for name, payload, method, crc, size in members:
        offset, encoded = len(body), name.encode()
        body += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0, crc, len(payload),
                            size, len(encoded), 0) + encoded + payload
        directory += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0, crc,
                                 len(payload), size, len(encoded), 0, 0, 0, 0, 0,
                                 offset) + encoded
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(directory),
                      len(body), 0)
    path.write_bytes(bytes(body + directory + end))
    return path


def stored(name: str, data: bytes) -> tuple[str, bytes, int, int, int]:
    return name, data, zipfile.ZIP_STORED, zlib.crc32(data), len(data)


RUNNER = textwrap.dedent("""
    import json, sys
    from cbcert.convert import pickles, stylegan2

    loaders = {"pickle": pickles.load_pickle, "zip": pickles.load_torch_zip,
               "stylegan2": stylegan2.load_snapshot}
    default_max = getattr(pickles, "MAX_PICKLE_BYTES", None)
    for name, loader, path, max_pickle in json.loads(sys.argv[1]):
        pickles.MAX_PICKLE_BYTES = max_pickle or default_max
        try:
            loaders[loader](path)
            outcome, message = "loaded", ""
        except ValueError as err:
            outcome, message = "refused", str(err)
        except Exception as err:  # anything but ValueError is a loader bug
            outcome, message = f"raised {type(err).__name__}", str(err)
        # VmHWM is this process's own high-water mark; ru_maxrss would also count the RSS of
        # the (large) pytest process this one was forked from, which Linux carries over exec.
        status = open("/proc/self/status").read()
        peak = int(status.split("VmHWM:")[1].split()[0]) * 1024
        print(json.dumps({"case": name, "outcome": outcome, "message": message, "peak": peak}),
              flush=True)
""")


def run_loaders(cases: list[tuple[str, str, Path, int | None]]) -> dict[str, dict]:
    """Load every case in one subprocess; a crash leaves the crashing case and later ones out.

    Returns ``case -> {"outcome", "message", "peak"}``, or ``{"crash": ...}`` for cases the
    subprocess never reported.
    """
    spec = json.dumps([[name, loader, str(path), limit] for name, loader, path, limit in cases])
    proc = subprocess.run([sys.executable, "-c", RUNNER, spec], capture_output=True, text=True,
                          cwd=REPO, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    results = {}
    for line in proc.stdout.splitlines():
        record = json.loads(line)
        results[record["case"]] = record
    missing = [name for name, *_ in cases if name not in results]
    for name in missing:
        where = "crashed loading this case" if name == missing[0] else "never reached this case"
        results[name] = {"crash": f"loader subprocess {where} (exit {proc.returncode}): "
                                  f"{proc.stderr[-2000:]}"}
    return results


# ------------------------------------------------------------------ crafted files


def plain_cases() -> dict[str, tuple]:
    """Concept-bank-style pickles (``load_pickle``): ``name -> (obj, expected message)``."""
    storage = np.arange(8, dtype=np.float32)
    return {
        "negative offset": (tensor(storage, -4, (4,), (1,)), "offset=-4; allowed: integers >= 0"),
        "size beyond storage": (tensor(storage, 0, (16,), (1,)),
                                "reaches element 15 of a storage of 8 elements"),
        "one past the end": (tensor(storage, 5, (2, 2), (2, 1)),
                             "reaches element 8 of a storage of 8 elements"),
        "huge stride": (tensor(storage, 0, (2,), (1 << 40,)),
                        f"reaches element {1 << 40} of a storage of 8 elements"),
        "int64-overflowing stride": (tensor(storage, 0, (3,), (1 << 62,)),
                                     f"reaches element {2 << 62}"),
        "negative stride": (tensor(storage, 3, (4,), (-1,)), "negative entries"),
        "negative size": (tensor(storage, 0, (-2,), (1,)), "negative entries"),
        "float offset": (tensor(storage, 1.5, (2,), (1,)), "offset=1.5"),
        "bool offset": (tensor(storage, True, (2,), (1,)), "offset=True"),
        "string size": (tensor(storage, 0, ("4",), (1,)), "size=('4',); expected a tuple"),
        "size and stride lengths": (tensor(storage, 0, (2, 2), (1,)), "differ in length"),
        "storage not an array": (tensor("abcdefgh", 0, (2,), (1,)), "tensor storage is str"),
        "2-D storage": (tensor(storage.reshape(2, 4), 0, (2,), (1,)),
                        "an array of shape (2, 4)"),
        "object storage": (tensor(np.array([1, None], dtype=object), 0, (2,), (1,)),
                           "dtype object"),
        "ndarray over raw bytes": (Call(np.ndarray, (2,), np.dtype("O"), b"\x41" * 16),
                                   "refusing to call numpy.ndarray"),
        "too few arguments": (Call(torch._utils._rebuild_tensor_v2, storage),
                              "not a readable pickle (TypeError"),
    }


def snapshot_cases() -> dict[str, tuple]:
    """StyleGAN2-snapshot-style pickles (``load_snapshot``, legacy storage blobs)."""
    storage = legacy_storage(torch.arange(8, dtype=torch.float32))
    return {
        "negative offset": ({"G_ema": tensor(storage, -2, (4,), (1,))}, "offset=-2"),
        "size beyond storage": ({"G_ema": tensor(storage, 4, (1 << 20,), (1,))},
                                "reaches element 1048579 of a storage of 8 elements"),
        "huge stride": ({"G_ema": tensor(storage, 0, (2, 2), (1 << 40, 1))},
                        f"reaches element {(1 << 40) + 1}"),
    }


def zip_cases() -> dict[str, tuple]:
    """Torch zip archives (``load_torch_zip``) whose member ``data/0`` holds 4 floats:
    ``name -> (data.pkl object, MAX_PICKLE_BYTES or None, expected message)``."""
    ok = ZipStorage("0", 4)
    return {
        "negative offset": (tensor(ok, -1, (4,), (1,)), None, "offset=-1"),
        "huge stride": (tensor(ok, 0, (2,), (1 << 40,)), None,
                        f"reaches element {1 << 40} of a storage of 4 elements"),
        "negative element count": (tensor(ZipStorage("0", -1), 0, (1,), (1,)), None,
                                   "storage '0' declares -1 elements"),
        "element count beyond member": (
            tensor(ZipStorage("0", 1000), 0, (1000,), (1,)), None,
            "archive/data/0 declares 16 bytes but its storage holds 4000"),
        "storage of 2**40 elements": (tensor(ZipStorage("0", 1 << 40), 0, (4,), (1,)), None,
                                      f"declares {1 << 40} elements"),
        "storage missing": (tensor(ZipStorage("7", 4), 0, (4,), (1,)), None,
                            "storage '7' missing from the archive"),
        "storage read as two sizes": (
            [tensor(ok, 0, (4,), (1,)), tensor(ZipStorage("0", 2), 0, (2,), (1,))], None,
            "storage '0' is referenced as 2"),
        "data.pkl over the limit": (tensor(ok, 0, (4,), (1,)), 64, "archive/data.pkl declares"),
    }


CASES = ([f"pickle: {name}" for name in plain_cases()]
         + [f"stylegan2: {name}" for name in snapshot_cases()]
         + [f"zip: {name}" for name in zip_cases()])


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    """Every crafted file, loaded in one subprocess: ``(results, case -> (path, message))``."""
    root = tmp_path_factory.mktemp("crafted")
    runs, expected = [], {}

    def add(name, loader, path, limit, message):
        runs.append((name, loader, path, limit))
        expected[name] = (path, message)

    for i, (name, (obj, message)) in enumerate(plain_cases().items()):
        path = root / f"bank{i}.pkl"
        path.write_bytes(pickle.dumps({"concept": (obj, 0.9, 0.8, np.zeros(1), {})}, protocol=2))
        add(f"pickle: {name}", "pickle", path, None, message)
    for i, (name, (obj, message)) in enumerate(snapshot_cases().items()):
        path = root / f"snapshot{i}.pkl"
        path.write_bytes(pickle.dumps(obj, protocol=2))
        add(f"stylegan2: {name}", "stylegan2", path, None, message)
    data = np.arange(4, dtype=np.float32).tobytes()
    for i, (name, (obj, limit, message)) in enumerate(zip_cases().items()):
        path = write_torch_zip(root / f"archive{i}.pt", obj, {"0": data})
        add(f"zip: {name}", "zip", path, limit, message)
    return run_loaders(runs), expected


@pytest.mark.parametrize("case", CASES)
def test_crafted_file_is_refused_naming_file_and_problem(crafted, case):
    results, expected = crafted
    path, message = expected[case]
    result = results[case]
    assert "crash" not in result, result["crash"]
    assert result["outcome"] == "refused", result
    assert result["message"].startswith(f"{path}:"), result["message"]
    assert message in result["message"], result["message"]


# ------------------------------------------------------------------ zip bombs


@pytest.fixture(scope="module")
def bombs(tmp_path_factory):
    """Archives of a few MB whose storages or tensors would take GiBs in memory."""
    root = tmp_path_factory.mktemp("bombs")
    payload = deflated_zeros(BOMB_BYTES)
    bomb_crc = zeros_crc(BOMB_BYTES)
    gib = 1 << 30
    gib_member = (deflated_zeros(gib), zipfile.ZIP_DEFLATED, zeros_crc(gib), gib)
    part = 3 * CHUNK  # 48 MiB, within the budget of a file of ~150 KB; two of them are not
    part_member = (deflated_zeros(part), zipfile.ZIP_DEFLATED, zeros_crc(part), part)
    small = tensor(ZipStorage("0", 4), 0, (4,), (1,))
    declared = tensor(ZipStorage("0", BOMB_BYTES // 4), 0, (4,), (1,))
    # three storages of 1 GiB each: every one within MAX_TENSOR_BYTES, 3 GiB in all
    three_gib = [tensor(ZipStorage(key, gib // 4), 0, (4,), (1,)) for key in "012"]
    three_parts = [tensor(ZipStorage(key, part // 4), 0, (4,), (1,)) for key in "012"]
    # three 1 GiB tensors, each repeating one element of a 16-byte storage (stride 0)
    three_views = [tensor(ZipStorage("0", 4), 0, (gib // 4,), (0,)) for _ in range(3)]
    cases = {  # the peak is the subprocess's high-water mark: the benign case goes first
        # the header lies (16 bytes) about a 2 GiB stream: only 16 bytes may be inflated
        "header under-states the member": (small, {"0": (payload, zipfile.ZIP_DEFLATED,
                                                         zlib.crc32(bytes(16)), 16)}, None),
        # the storage needs 16 bytes, the member honestly declares 2 GiB
        "member larger than its storage": (small, {"0": (payload, zipfile.ZIP_DEFLATED,
                                                         bomb_crc, BOMB_BYTES)},
                                           f"declares {BOMB_BYTES} bytes but its storage holds "
                                           "16"),
        # the pickle itself declares a 2 GiB storage
        "storage larger than the limit": (declared, {"0": (payload, zipfile.ZIP_DEFLATED,
                                                           bomb_crc, BOMB_BYTES)},
                                          f"declares {BOMB_BYTES // 4} elements"),
        "storages of GiBs from MBs": (three_gib, dict.fromkeys("012", gib_member),
                                      "storage '0' would bring what the file holds to "),
        "storages larger than the total": (three_parts, dict.fromkeys("012", part_member),
                                           "storage '1' would bring what the file holds to "),
        "tensors larger than the total": (three_views, {"0": stored("", bytes(16))[1:]},
                                          "tensor of size (268435456,) would bring what the "
                                          "file holds to "),
    }
    runs, expected = [], {}
    for i, (name, (obj, members, message)) in enumerate(cases.items()):
        path = write_raw_zip(root / f"bomb{i}.pt", [
            stored("archive/data.pkl", data_pkl(obj)), stored("archive/byteorder", b"little"),
            *((f"archive/data/{key}", *member) for key, member in members.items())])
        assert path.stat().st_size < BOMB_BYTES // 256
        runs.append((name, "zip", path, None))
        expected[name] = (path, message)
    return run_loaders(runs), expected


@pytest.mark.parametrize("case", ["header under-states the member",
                                  "member larger than its storage",
                                  "storage larger than the limit",
                                  "storages of GiBs from MBs",
                                  "storages larger than the total",
                                  "tensors larger than the total"])
def test_zip_bomb_is_not_inflated(bombs, case):
    results, expected = bombs
    path, message = expected[case]
    result = results[case]
    assert "crash" not in result, result["crash"]
    assert result["peak"] < PEAK_LIMIT, f"peak RSS {result['peak']} bytes"
    if message is None:
        assert result["outcome"] == "loaded", result
    else:
        assert result["outcome"] == "refused", result
        assert result["message"].startswith(f"{path}:") and message in result["message"]


# ------------------------------------------------------------------ legitimate files


def reference_tensors() -> dict[str, torch.Tensor]:
    """Every kind of view torch writes: offsets, transposes, expands, shared and empty storages."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "contiguous": base, "transposed": base.t(), "sliced": base[1:3, 2:5],
        "strided": base[::2, ::3], "shared_row": base[3], "expanded": torch.arange(3.).expand(4, 3),
        "scalar": torch.tensor(2.5), "element": base[2, 4], "empty": torch.zeros(0, 3),
        "int64": torch.arange(5, dtype=torch.int64) - 2, "bool": torch.tensor([True, False]),
        "half": torch.linspace(-1, 1, 7, dtype=torch.float16),
        "bfloat16": torch.linspace(-1, 1, 7, dtype=torch.bfloat16),
        "double": torch.linspace(-1, 1, 6, dtype=torch.float64).reshape(3, 2) / 3,
    }


def assert_same(loaded: dict, reference: dict[str, torch.Tensor]) -> None:
    assert set(loaded) == set(reference)
    for name, expected in reference.items():
        got = loaded[name]
        if expected.dtype == torch.bfloat16:
            assert got.dtype == ml_dtypes.bfloat16, name
            expected = expected.float()
            got = got.astype(np.float32)
        assert got.shape == tuple(expected.shape), name
        np.testing.assert_array_equal(got, expected.numpy(), err_msg=name)


def test_torch_save_loads_identically(tmp_path):
    reference = reference_tensors()
    torch.save(reference, tmp_path / "t.pt")
    assert_same(pickles.load_torch_zip(tmp_path / "t.pt"), reference)


def test_big_endian_archive_loads_identically(tmp_path):
    values = np.arange(6, dtype=np.float32) - 2.5
    path = tmp_path / "be.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", data_pkl(tensor(ZipStorage("0", 6), 1, (2, 2),
                                                             (1, 2))))
        archive.writestr("archive/byteorder", "big")
        archive.writestr("archive/data/0", values.astype(">f4").tobytes())
    np.testing.assert_array_equal(pickles.load_torch_zip(path), [[-1.5, 0.5], [-0.5, 1.5]])


def test_plain_pickled_tensors_load_identically(tmp_path):
    """StyleGAN2 snapshots pickle tensors with legacy ``_load_from_bytes`` storage blobs."""
    reference = reference_tensors()
    (tmp_path / "s.pkl").write_bytes(pickle.dumps(reference))
    assert_same(load_snapshot(tmp_path / "s.pkl"), reference)


@pytest.mark.parametrize("protocol", [2, 4])
def test_numpy_pickles_load_identically(tmp_path, protocol):
    rng = np.random.default_rng(0)
    bank = {"striped": (rng.normal(size=(1, 5)), 0.9, 0.8, rng.normal(size=1),
                        {"max": np.float64(1.5), "pos_count": np.int64(50)}),
            "names": ["a", "b"], "fortran": np.asfortranarray(rng.normal(size=(3, 2))),
            "objects": np.array([1, "x", None], dtype=object)}
    (tmp_path / "bank.pkl").write_bytes(pickle.dumps(bank, protocol=protocol))
    loaded = pickles.load_pickle(tmp_path / "bank.pkl")
    np.testing.assert_array_equal(loaded["striped"][0], bank["striped"][0])
    assert loaded["striped"][4] == {"max": 1.5, "pos_count": 50}
    np.testing.assert_array_equal(loaded["fortran"], bank["fortran"])
    assert list(loaded["objects"]) == [1, "x", None] and loaded["names"] == ["a", "b"]


def test_byte_budget_is_relative_to_the_file_and_capped_absolutely():
    small, large = pickles.ByteBudget("f", 1000), pickles.ByteBudget("f", 1 << 30)
    assert small.limit == 16 * 1000 + (64 << 20) and large.limit == pickles.MAX_TOTAL_BYTES
    large.take(pickles.MAX_TOTAL_BYTES - 8, "storage 'a'")
    with pytest.raises(ValueError, match=f"f: storage 'b' would bring what the file holds to "
                                         f"{pickles.MAX_TOTAL_BYTES + 8} bytes in all; at most "
                                         f"{pickles.MAX_TOTAL_BYTES}"):
        large.take(16, "storage 'b'")


def test_view_reaching_the_last_element_is_accepted():
    storage = np.arange(8, dtype=np.float32)
    np.testing.assert_array_equal(pickles.checked_view(storage, 4, (2, 2), (2, 1)),
                                  [[4, 5], [6, 7]])
    assert pickles.checked_view(storage, 1 << 40, (0, 5), (1, 1)).shape == (0, 5)
    # torch lets a size-1 dimension carry any stride; it never steps, so it never reads
    np.testing.assert_array_equal(pickles.checked_view(storage, 2, (1, 3), (1 << 62, 1)),
                                  [[2, 3, 4]])


# ------------------------------------------------------------------ through the CLI


def certify(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cbcert", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_convert_refuses_a_crafted_checkpoint_with_exit_2(tmp_path):
    checkpoint = write_torch_zip(tmp_path / "pcbm.ckpt", tensor(ZipStorage("0", 4), -1, (4,),
                                                                (1,)),
                                 {"0": bytes(16)})
    torch.save({"fc.weight": torch.zeros(2, 2)}, tmp_path / "backbone.pth")
    proc = certify("convert", "pcbm", str(checkpoint), str(tmp_path / "out"), "--backbone",
                   "resnet18", "--backbone-path", str(tmp_path / "backbone.pth"))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output
    assert f"{checkpoint}: tensor storage offset=-1" in " ".join(output.split())


def test_world_refuses_a_crafted_stylegan2_pickle_with_exit_2(tmp_path):
    storage = legacy_storage(torch.arange(8, dtype=torch.float32))
    (tmp_path / "g.pkl").write_bytes(pickle.dumps({"G_ema": tensor(storage, 0, (2,),
                                                                   (1 << 40,))}))
    for name in ("cbae.pt", "cbae.yaml"):
        (tmp_path / name).write_bytes(b"")
    for name in ("std", "cbm"):
        (tmp_path / name).mkdir()
    manifest = {"format_version": 1,
                "generator": {"kind": "stylegan2", "pickle": "g.pkl"},
                "cbae": {"checkpoint": "cbae.pt", "config": "cbae.yaml"},
                "classifiers": {"std": "std", "cbm": "cbm"}, "class_names": ["a", "b"],
                "preprocess": {"size": None, "mean": [0, 0, 0], "std": [1, 1, 1]}}
    (tmp_path / "world.json").write_text(json.dumps(manifest))
    proc = certify("latent", "--sigma", "0.1", "--world", str(tmp_path), "--out",
                   str(tmp_path / "run"), "--quiet")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output
    flat = " ".join(output.split())
    assert "g.pkl: tensor view" in flat and f"reaches element {1 << 40}" in flat
