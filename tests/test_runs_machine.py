"""The machine description a sweep's session log records (`cbcert.runs.machine`)."""

import subprocess

from cbcert.runs import machine


def test_describe_names_the_cpu_its_known_isa_flags_and_cpus():
    info = machine.describe()
    assert set(info) == {"cpu", "isa", "logical_cpus", "platform"}
    assert info["cpu"] and info["logical_cpus"] >= 1 and info["platform"]
    assert set(info["isa"]) <= set(machine.ISA_FLAGS)
    assert info["isa"] == [f for f in machine.ISA_FLAGS if f in info["isa"]]  # in ISA_FLAGS order


def test_lscpu_fields_are_parsed_and_its_absence_is_not_an_error(monkeypatch):
    text = "Model name:   Test CPU 9000\nFlags:   fpu avx2 sse avx512f amx_bf16 fma\n"
    monkeypatch.setattr(subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=text))
    assert machine.cpu_description() == ("Test CPU 9000", ["avx2", "fma", "avx512f", "amx_bf16"])

    def missing(*a, **k):
        raise FileNotFoundError("lscpu")

    monkeypatch.setattr(subprocess, "run", missing)
    model, flags = machine.cpu_description()
    assert model and flags == []


def test_provenance_is_what_a_session_records_about_itself():
    import cbcert

    own = machine.provenance()
    assert set(own) == {"git_revision", "versions", "machine"}
    assert own["versions"]["cbcert"] == cbcert.__version__
    assert set(own["versions"]) == {"cbcert", "jax", "flax", "numpy"}
    assert own["machine"]["cpu"] == machine.describe()["cpu"]
    assert own["git_revision"] == machine.git_revision()
