"""Two CPU processes forming one jax.distributed job count exactly like one process."""

import json

import numpy as np
import processes as testing
import pytest

from cbcert.engine import distributed

WORKER = """
import json, sys
from cbcert.engine import distributed
distributed.initialize("127.0.0.1:{port}", num_processes=2, process_id={rank},
                       cpu_collectives="gloo", initialization_timeout=120)
import jax, jax.numpy as jnp, numpy as np
from cbcert.engine import keys, noise, sampler
assert jax.process_count() == 2 and len(jax.devices()) == 4, jax.devices()
weights = np.asarray(jax.random.normal(jax.random.key(1), (6, 2, 4)))
inputs = np.asarray(jax.random.normal(jax.random.key(2), (5, 6)))
heads = lambda params, x: jnp.einsum("bd,dhc->bhc", x, params)
counts = sampler.count_classes(heads, weights, inputs, noise.Gaussian(),
                               keys.stream_key(jax.random.key(0), keys.STREAM_SELECT), 45,
                               scale=0.8, num_classes=4, chunk_size=7)
texts = distributed.gather_text(f"from {{jax.process_index()}}")
print("RESULT " + json.dumps(dict(rank=jax.process_index(), counts=counts.tolist(),
                                  coordinator=distributed.is_coordinator(), texts=texts)))
distributed.shutdown()
"""

SINGLE = """
import json
import jax, jax.numpy as jnp, numpy as np
from cbcert.engine import keys, noise, sampler
weights = np.asarray(jax.random.normal(jax.random.key(1), (6, 2, 4)))
inputs = np.asarray(jax.random.normal(jax.random.key(2), (5, 6)))
heads = lambda params, x: jnp.einsum("bd,dhc->bhc", x, params)
counts = sampler.count_classes(heads, weights, inputs, noise.Gaussian(),
                               keys.stream_key(jax.random.key(0), keys.STREAM_SELECT), 45,
                               scale=0.8, num_classes=4, chunk_size=64)
print("RESULT " + json.dumps(dict(counts=counts.tolist())))
"""


def _result(stdout: str) -> dict:
    line = next(line for line in stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_two_processes_match_one_process():
    port = testing.free_port()
    workers = [
        testing.start_python(WORKER.format(port=port, rank=rank), num_devices=2)
        for rank in (0, 1)
    ]
    single = testing.start_python(SINGLE, num_devices=1)
    results = [_result(testing.wait_python(worker, timeout=240)) for worker in workers]
    reference = np.asarray(_result(testing.wait_python(single, timeout=240))["counts"])
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["coordinator"] for r in results] == [True, False]
    assert [r["texts"] for r in results] == [["from 0", "from 1"]] * 2
    for result in results:
        np.testing.assert_array_equal(result["counts"], reference)


def test_initialize_validates_ranks():
    with pytest.raises(ValueError, match="process_id=2 must be in \\[0, num_processes=2\\)"):
        distributed.initialize("127.0.0.1:1", num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="num_processes=0"):
        distributed.initialize("127.0.0.1:1", num_processes=0, process_id=0)
    with pytest.raises(ValueError, match="initialization_timeout=0"):
        distributed.initialize("127.0.0.1:1", num_processes=2, process_id=1,
                               initialization_timeout=0)
    assert distributed.gather_text("alone") == ["alone"]  # outside a job
    assert distributed.notice_after(300) == distributed.NOTICE_AFTER
    assert distributed.notice_after(4) == 2
