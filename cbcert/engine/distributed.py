"""Multi-host start-up: one ``jax.distributed`` job over several processes (TPU pod slice, GPUs
on several hosts, or CPU processes for testing).

Call ``initialize`` once per process before any other JAX call; afterwards ``jax.devices()``
lists the devices of every process, the sampler's default mesh spans all of them, and each
process passes the same inputs and key and receives the same counts.
"""

import jax


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: list[int] | None = None,
    cpu_collectives: str | None = None,
    initialization_timeout: int = 300,
) -> None:
    """Joins this process to a multi-host JAX job (wraps ``jax.distributed.initialize``).

    On TPU pods and SLURM/Kubernetes clusters all arguments can stay None (auto-detected).

    Args:
      coordinator_address: ``"host:port"`` of process 0, reachable by every process.
      num_processes: number of processes in the job, ``>= 1``.
      process_id: rank of this process in ``[0, num_processes)``.
      local_device_ids: devices of this host the process owns (default: all).
      cpu_collectives: for CPU-only jobs, the cross-process collectives implementation
        (``"gloo"``); this sets the global ``jax_cpu_collectives_implementation`` option,
        which must happen before the CPU backend starts.
      initialization_timeout: seconds to wait for every process to join.
    """
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes={num_processes} must be >= 1")
    if process_id is not None and num_processes is not None and not (
        0 <= process_id < num_processes
    ):
        raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=initialization_timeout,
    )


def shutdown() -> None:
    """Leaves the multi-host job (``jax.distributed.shutdown``)."""
    jax.distributed.shutdown()


def is_coordinator() -> bool:
    """True on process 0, the one that should write result files and print."""
    return jax.process_index() == 0
