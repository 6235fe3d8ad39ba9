"""The data path: moving KV-cache pages between GPU caches and a host pool.

``layout`` sees every cache tensor as byte planes and lays out pool rows; ``jobs`` turns
a job (``JobSpec``) into validated pair tables; ``copiers`` moves them (the Triton
kernel of ``triton_offload.kernels``, batched DMA through ``batch_copy``, or the CPU
path of ``cpu_copy``) behind one small interface; ``selection`` picks a copier per plane
and calibrates the crossover; ``pool`` allocates and page-locks the host pool;
``engine`` owns streams, events, FIFO completion and the job lifecycle;
``host_blocks`` maps chunk keys to pool rows for engines other than vLLM; ``reference``
is the plain-Python copy the tests compare against.

Depends on the planner (``triton_offload.planner``) only; nothing here imports vLLM.
This package imports nothing on its own so that one module can be loaded without the
others (the CPU path runs without Triton).
"""
